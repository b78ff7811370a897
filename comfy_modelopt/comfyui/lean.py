"""Lean runtime: the same quantized layers and kernels as stock ComfyUI, without its per-call
Python dispatch, plus CUDA-graph replay of whole model evaluations.

``make_lean(patcher)`` rebinds the forward of every quantized ``MixedPrecisionOps.Linear`` of a
model *we created* (Quantize Model / Load Quantized Model output) to a direct call of the kernel
the stock path ends in:

- fp8 with a static input scale: kitchen's fused activation quantizer + ``scaled_mm`` (bit-exact
  with stock; ``fast_accum`` trades exactness for Hopper's fast fp8 accumulation);
- int8 / int8+ConvRot: kitchen's ``int8_linear`` op (what the stock dispatch calls);
- formats this GPU cannot compute (nvfp4/mxfp8 before Blackwell, fp8 weight-only, ...): kitchen's
  dequantization kernel + one 16-bit GEMM, as stock does - or, within the budget of a
  ``DequantCache`` (``dequant_cache_bytes``), the GEMM alone on a kept 16-bit copy.

Whenever a layer is offloaded, patched by a LoRA at run time (weight functions), or holds a
16-bit weight, the stock forward runs instead.  ``CudaGraphs`` (installed as a model-function
wrapper on a clone, so it works for 16-bit models too) captures each distinct input signature
once and replays it; anything it cannot capture runs eagerly with the reason logged.

With ``compile_blocks`` the graphs are captured over the repeated transformer blocks compiled
by TorchInductor (``CompiledBlocks``): the 16-bit, memory-bound work between the GEMMs - norms,
modulation, gated residuals, RoPE, concatenations, the activation function - is fused into fewer
kernels, while every weight-holding layer stays opaque to the compiler (the quantized layers'
tensor subclasses are not traceable, and a GEMM gains nothing from tracing).  Inductor output is
never trusted: the first evaluation of every input signature is run both ways and compared, and a
difference beyond 3x eager's own rounding noise (``CompiledBlocks.validate``) turns compilation
off for the model, logged.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import time
import types

import torch

import comfy.model_management
from comfy.patcher_extension import CallbacksMP, WrappersMP

from ..cuda_streams import on_side_stream

try:
    from comfy.quant_ops import QuantizedTensor
except ImportError:  # pragma: no cover - ComfyUI without quant_ops cannot run quantized models
    QuantizedTensor = ()

_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _native_formats(device) -> set:
    """Formats ComfyUI computes natively on ``device`` (its own gates)."""
    mm = comfy.model_management
    native = {"int8_tensorwise", "convrot_w4a4"}
    if mm.supports_fp8_compute(device):
        native |= {"float8_e4m3fn", "float8_e5m2"}
    if mm.supports_nvfp4_compute(device):
        native.add("nvfp4")
    if mm.supports_mxfp8_compute(device):
        native.add("mxfp8")
    return native


def _fast_path_ok(module, x) -> bool:
    w = module.weight
    return (isinstance(w, QuantizedTensor) and w.device == x.device and not module.weight_function
            and not module.bias_function and not getattr(module, "comfy_force_cast_weights", False)
            and not getattr(module, "comfy_cast_weights", False) and not x.requires_grad)


def _bias(module, x):
    b = module.bias
    if b is None:
        return None
    return b if (b.dtype == x.dtype and b.device == x.device) else b.to(device=x.device, dtype=x.dtype)


def _fp8_forward(module, x, fast_accum: bool):
    from comfy_kitchen.scaled_mm_v2 import scaled_mm_v2
    import comfy_kitchen as ck
    w = module.weight
    x2 = x.reshape(-1, x.shape[-1])
    scale_a = module.input_scale
    xq = ck.quantize_per_tensor_fp8(x2, scale_a, w._qdata.dtype)
    if fast_accum:
        out = torch._scaled_mm(xq, w._qdata.t(), scale_a=scale_a, scale_b=w._params.scale,
                               bias=_bias(module, x), out_dtype=x.dtype, use_fast_accum=True)
    else:
        out = scaled_mm_v2(xq.contiguous(), w._qdata.t(), scale_a, w._params.scale, _bias(module, x), x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _int8_forward(module, x):
    from comfy_kitchen.tensor.int8 import _dtype_code
    w = module.weight
    p = w._params
    return torch.ops.comfy_kitchen.int8_linear(x.contiguous(), w._qdata, p.scale, _bias(module, x),
                                               _dtype_code(x.dtype), bool(getattr(p, "convrot", False)),
                                               int(getattr(p, "convrot_groupsize", 256)))


def _dequant_forward(module, x, cache=None):
    w = cache.get(module, x) if cache is not None else None
    if w is None:
        w = module.weight.dequantize().to(x.dtype)
    return torch.nn.functional.linear(x, w, _bias(module, x))


class DequantCache:
    """Dequantized copies of the weights the GPU cannot compute natively (nvfp4/mxfp8 before
    Blackwell), within a byte budget: a cached layer runs a plain 16-bit GEMM instead of
    dequantizing on every call (same values, so the output is bit-identical).

    Filled by the first evaluations, in call order, until the budget is spent - never inside a
    CUDA-graph capture (the graph runtime warms up eagerly first, so the cache is full by then).
    Every byte saves about the same dequantization time, so no order is better than another.
    An entry is dropped when its weight changes (LoRA merged or unmerged: new storage or a new
    weight-patch uuid).  The whole cache goes when ComfyUI detaches the model from the GPU, and
    the part of the budget not yet allocated is added to the model's ``memory_required``, so
    ComfyUI frees that much before sampling instead of being surprised by it."""

    def __init__(self, patcher, budget_bytes: int):
        self.model, self.budget = patcher.model, int(budget_bytes)
        self.entries: dict = {}  # id(module) -> (key, tensor, module)
        self.used = 0
        self.hits = self.fills = 0

    def _weight_version(self, module) -> tuple:
        """Changes whenever the weight does: new storage, or ComfyUI patched it in place."""
        return module.weight._qdata.data_ptr(), getattr(self.model, "current_weight_patches_uuid", None)

    def get(self, module, x):
        key = (self._weight_version(module), x.dtype, x.device)
        entry = self.entries.get(id(module))
        if entry is not None:
            if entry[0] == key:
                self.hits += 1
                return entry[1]
            del self.entries[id(module)]
            self.used -= entry[1].numel() * entry[1].element_size()
        nbytes = module.weight.numel() * x.element_size()
        if self.used + nbytes > self.budget or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        w = module.weight.dequantize().to(x.dtype)
        self.entries[id(module)] = (key, w, module)
        self.used += nbytes
        self.fills += 1
        return w

    def needs_fill(self) -> bool:
        """Empty (after a release) or holding copies of weights that changed since: an eager pass
        should refill it before a CUDA graph is captured (a capture cannot fill it)."""
        if self.budget and not self.entries:
            return True
        return any(key[0] != self._weight_version(m) for key, _w, m in self.entries.values())

    def release(self, *_args) -> None:
        self.entries.clear()
        self.used = 0

    def unallocated(self) -> int:
        return max(0, self.budget - self.used)


def _reserve_cache_memory(model, cache: DequantCache) -> None:
    """ComfyUI sizes the memory it frees before sampling with ``model.memory_required``."""
    base = model.memory_required

    def memory_required(*args, **kwargs):
        return base(*args, **kwargs) + cache.unallocated()
    model.memory_required = memory_required


def make_lean(patcher, fast_accum: bool = False, dequant_cache_bytes: int = 0) -> int:
    """Rebind quantized Linear forwards of ``patcher``'s own model; returns how many.

    ``dequant_cache_bytes``: budget of a ``DequantCache`` for the layers computed dequantized
    (``patcher.model._modelopt_dequant_cache`` afterwards; none for 0)."""
    device = patcher.load_device
    native = _native_formats(device)
    count = dequantized = 0
    cache = getattr(patcher.model, "_modelopt_dequant_cache", None)
    new_cache = dequant_cache_bytes > 0 and cache is None
    if new_cache:
        cache = DequantCache(patcher, dequant_cache_bytes)
        patcher.model._modelopt_dequant_cache = cache
        _reserve_cache_memory(patcher.model, cache)
        patcher.add_callback_with_key(CallbacksMP.ON_DETACH, "comfy_modelopt_dequant_cache", cache.release)
    for module in patcher.model.diffusion_model.modules():
        fmt = getattr(module, "quant_format", None)
        if fmt is None or getattr(module, "_modelopt_lean", False):
            continue
        # own-loader layers wrap their base forward: make that one lean, keep the wrapper; a
        # forward injected by someone else (ComfyUI's bypass LoRA hook keeps the layer's own one
        # in ``original_forward``) stays on top, the lean one goes underneath it
        owner, attr = module, "forward"
        if hasattr(module, "_modelopt_base_forward"):
            attr = "_modelopt_base_forward"
        elif "forward" in module.__dict__ and getattr(module.forward, "__self__", module) is not module:
            hook = module.forward.__self__
            if getattr(hook, "original_forward", None) is None:
                logging.warning(f"[comfy-modelopt] lean runtime: {type(module).__name__} has a foreign "
                                "forward injected; left on the stock path")
                continue
            owner, attr = hook, "original_forward"
        stock = getattr(owner, attr)
        full_precision = module._full_precision_mm or fmt not in native
        if fmt in _FP8 and not full_precision and getattr(module, "input_scale", None) is not None:
            fast = lambda m, x, fa=fast_accum: _fp8_forward(m, x, fa)  # noqa: E731
        elif fmt == "int8_tensorwise" and not full_precision:
            fast = _int8_forward
        elif full_precision:
            fast = lambda m, x, c=cache: _dequant_forward(m, x, c)  # noqa: E731
            dequantized += module.weight.numel()
        else:
            continue  # natively computed formats without a lean path (e.g. nvfp4 on Blackwell)

        def forward(self, input, *args, _fast=fast, _stock=stock, **kwargs):
            if _fast_path_ok(self, input):
                return _fast(self, input)
            return _stock(input, *args, **kwargs)
        setattr(owner, attr, types.MethodType(forward, module))
        module._modelopt_lean = True
        count += 1
    if new_cache:
        # never reserve more than the layers computed dequantized can use (at the compute dtype)
        cache.budget = min(cache.budget, dequantized * patcher.model.get_dtype_inference().itemsize)
    return count


# ====================================================================== CUDA graphs

# wrapper kinds that run around the model evaluation, never inside the captured region
_WRAPPERS_OUTSIDE_MODEL = frozenset({WrappersMP.OUTER_SAMPLE, WrappersMP.PREPARE_SAMPLING, WrappersMP.SAMPLER_SAMPLE,
                                     WrappersMP.PREDICT_NOISE, WrappersMP.CALC_COND_BATCH})
# every ModelPatcher callback kind ComfyUI defines: lifecycle events, none runs inside a forward
_PATCHER_LIFECYCLE_CALLBACKS = frozenset(v for k, v in vars(CallbacksMP).items() if k.startswith("ON_"))


class CudaGraphs:
    """Model-function wrapper: capture ``apply_model`` per input signature, then replay.

    A signature is the shapes/dtypes of every tensor argument plus the non-tensor values; the
    weights' storage addresses are checked before each replay (a model unloaded and reloaded
    elsewhere is captured again).  Runs eagerly, logging why, when the model is partially
    loaded, when transformer options carry patches, or when capture fails."""

    replays_skip_hooks = True  # module hooks (calibration statistics) run only while capturing

    def __init__(self, patcher, max_graphs: int = 8, compile_blocks: bool = False):
        self.patcher, self.max_graphs = patcher, max_graphs
        self.compiled = CompiledBlocks(patcher.model.diffusion_model) if compile_blocks else None
        self.graphs: dict = {}
        self.pool = None
        self.warned: set = set()
        self.eager_calls = self.replays = self.captures = self.releases = 0
        self.capture_seconds: list = []  # wall time of each capture (with its warm-up / compilation)
        self.warmed: set = set()  # signatures whose lazy inits/compilation already ran
        self.validated: set = set()  # signatures whose compiled blocks matched eager

    def release(self, *_args) -> None:
        """Drop every captured graph and the memory pool they share.

        Called by ComfyUI after each sampling run (``cleanup``) and when the model is detached
        from the GPU: a graph pool's free blocks look reusable to ComfyUI's free-memory estimate
        but only the graphs can use them, so keeping them between runs would make ComfyUI
        overestimate free VRAM while it loads the VAE or another model.  The next run captures
        again (about one forward per input signature, two with compiled blocks; compilation and
        validation are not repeated)."""
        if self.graphs or self.pool is not None:
            self.graphs.clear()
            self.pool = None
            self.releases += 1

    # --------------------------------------------------------------- helpers
    def _eager(self, apply_model, args, reason: str):
        if reason not in self.warned:
            self.warned.add(reason)
            logging.info(f"[comfy-modelopt] CUDA graphs: running eagerly ({reason})")
        self.eager_calls += 1
        return apply_model(args["input"], args["timestep"], **args["c"])

    def _signature(self, args):
        flat = []

        def walk(v):
            if isinstance(v, torch.Tensor):
                flat.append(("T", tuple(v.shape), v.dtype, str(v.device)))
            elif isinstance(v, dict):
                for k in sorted(v, key=str):
                    flat.append(("K", str(k)))
                    walk(v[k])
            elif isinstance(v, (list, tuple)):
                flat.append(("L", len(v)))
                for x in v:
                    walk(x)
            elif isinstance(v, (int, float, str, bool, type(None))):
                flat.append(("V", v))
            else:
                raise TypeError(type(v).__name__)
        walk({"input": args["input"], "timestep": args["timestep"], "c": args["c"]})
        return tuple(flat)

    def _compute_dtype(self):
        model = self.patcher.model
        try:
            dtype = model.get_dtype_inference()
        except Exception:  # pragma: no cover - older ComfyUI
            return None
        return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else None

    def _weights_key(self):
        model = self.patcher.model
        return (getattr(model, "current_weight_patches_uuid", None),
                tuple(p.data_ptr() for p in model.diffusion_model.parameters()))

    def _blocker(self, args) -> str | None:
        # what the model carries first, the device last: a CPU test then sees every other reason
        topts = args["c"].get("transformer_options", {})
        patched = _carried_patches(topts)
        if patched:
            return f"transformer_options carries {patched}"
        # ComfyUI's sampler copies the patcher's wrappers and callbacks into transformer_options
        # (sampler_helpers.prepare_model_patcher) - our own release callbacks too.  Only wrappers
        # that run inside the model evaluation would be frozen into a graph; patcher callbacks
        # are lifecycle events (load, detach, cleanup, ...) that never run during it.
        for kind, per_key in (topts.get("wrappers") or {}).items():
            if kind not in _WRAPPERS_OUTSIDE_MODEL and _nonempty(per_key):
                return f"transformer_options carries {kind} wrappers"
        for kind, per_key in (topts.get("callbacks") or {}).items():
            if kind not in _PATCHER_LIFECYCLE_CALLBACKS and _nonempty(per_key):
                return f"transformer_options carries {kind} callbacks"
        model = self.patcher.model
        if getattr(model, "model_lowvram", False) or getattr(model, "lowvram_patch_counter", 0):
            return "model partially loaded (offloading)"
        if args["input"].device.type != "cuda":
            return "not on a CUDA device"
        return None

    # --------------------------------------------------------------- wrapper
    def __call__(self, apply_model, args):
        reason = self._blocker(args)
        if reason:
            return self._eager(apply_model, args, reason)
        c = dict(args["c"])
        topts = c.pop("transformer_options", {})
        try:
            sig = self._signature({"input": args["input"], "timestep": args["timestep"], "c": c})
        except TypeError as e:
            return self._eager(apply_model, args, f"unsupported argument type {e}")
        weights = self._weights_key()
        entry = self.graphs.get(sig)
        if entry is not None and entry["weights"] != weights:
            self.graphs.clear()
            entry = None
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                return self._eager(apply_model, args, f"more than {self.max_graphs} input signatures")
            try:
                entry = self._capture(apply_model, args, c, topts, weights, sig)
            except Exception as e:  # capture can fail on host syncs or unsupported ops
                self.graphs.pop(sig, None)
                return self._eager(apply_model, args, f"capture failed: {type(e).__name__}: {str(e)[:300]}")
            self.graphs[sig] = entry
            return entry["out"].clone()
        for dst, src in zip(entry["static"], _tensors(args["input"], args["timestep"], c)):
            dst.copy_(src, non_blocking=True)
        entry["graph"].replay()
        self.replays += 1
        return entry["out"].clone()

    def _capture(self, apply_model, args, c, topts, weights, sig):
        t0 = time.perf_counter()
        # Conditioning can arrive on the CPU (SDXL's ADM vector and Flux's guidance are built
        # there); apply_model would copy it to the GPU on every call, and a host-to-device copy
        # cannot be captured.  apply_model moves every conditioning tensor to the input's device
        # anyway, so the static copies live there; replays copy new values into them.
        device = args["input"].device
        static_x = args["input"].clone()
        static_t = _clone_tree(args["timestep"], device)
        static_c = _clone_tree(c, device)
        static_c["transformer_options"] = topts
        use_compiled = self.compiled is not None and self.compiled.enabled and sig in self.validated
        run = lambda: apply_model(static_x, static_t, **static_c)  # noqa: E731
        cache = getattr(self.patcher.model, "_modelopt_dequant_cache", None)
        if sig not in self.warmed:
            def warm_up():  # outside the capture: lazy inits, autotuning, compilation, dequant cache
                ref = run()
                return self.compiled is not None and self.compiled.validate(
                    run, ref, lambda: apply_model(rounding_noise(static_x, self._compute_dtype()), static_t,
                                                  **static_c))
            use_compiled = on_side_stream(warm_up)
            self.warmed.add(sig)
            if use_compiled:
                self.validated.add(sig)
        elif use_compiled:
            # a new run's transformer_options may fail a compiled guard: any recompilation (and
            # Inductor's autotuning) must happen here, never inside the capture
            def warm_up_compiled():
                with self.compiled.installed():
                    run()
            on_side_stream(warm_up_compiled)
        elif cache is not None and cache.needs_fill():
            on_side_stream(run)  # refill the dequant cache (released on detach, or weights changed)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with self.compiled.installed() if use_compiled else contextlib.nullcontext():
            with torch.cuda.graph(graph, pool=self.pool):
                out = run()
        self.captures += 1
        graph.replay()
        torch.cuda.current_stream().synchronize()
        self.capture_seconds.append(round(time.perf_counter() - t0, 3))
        static_c.pop("transformer_options")
        return {"graph": graph, "static": _tensors(static_x, static_t, static_c), "out": out, "weights": weights}


def _rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def rounding_noise(x, dtype=None):
    """``x`` with relative noise of half the epsilon of ``dtype`` (the model's compute dtype;
    default ``x``'s own): one more rounding to that dtype, reproducibly."""
    g = torch.Generator(device=x.device).manual_seed(0)
    noise = torch.randn(x.shape, generator=g, device=x.device, dtype=torch.float32)
    eps = torch.finfo(dtype or x.dtype).eps
    return (x.float() * (1 + noise * (eps / 2))).to(x.dtype)


def _options_position(m) -> int | None:
    """Where ``m.forward`` takes ``transformer_options`` (positional index after self), or None."""
    try:
        params = [n for n in inspect.signature(type(m).forward).parameters if n != "self"]
    except (TypeError, ValueError):
        return None
    return params.index("transformer_options") if "transformer_options" in params else None


def _block_regions(model) -> list:
    out = []

    def add_one(m):
        out.append(m)
        # a layer that runs its own list of blocks, handing each its index in transformer_options
        # (a UNet's SpatialTransformer and its transformer blocks): the blocks are regions too,
        # so that their compiled code never sees the index (see CompiledBlocks)
        for c in m.children():
            if isinstance(c, torch.nn.ModuleList) and len(c) and all(_options_position(b) is not None for b in c):
                out.extend(c)

    def add(m):
        if isinstance(m, torch.nn.Sequential):  # iterated by the model itself: its layers
            for c in m.children():
                add_one(c)
        else:
            add_one(m)
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for m in child:
                add(m)
        elif isinstance(child, torch.nn.Sequential) and any(isinstance(c, torch.nn.Sequential) or
                                                             len(list(c.children())) for c in child.children()):
            add(child)  # e.g. a UNet's middle block
    return out


# ====================================================================== compiled blocks
_WEIGHT_LAYERS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
_PER_BLOCK_KEYS = ("block", "block_index", "transformer_index")  # per-block constants for patch lookups


class CompiledBlocks:
    """TorchInductor-compiled forwards of a model's blocks, installed on demand.

    Regions are the elements of every ``nn.ModuleList`` directly under the diffusion model
    (Flux's double/single blocks, DiT blocks); where an element (or a direct child) is an
    ``nn.Sequential`` that the model iterates itself - a UNet's ``TimestepEmbedSequential`` - its
    layers (ResBlock, SpatialTransformer, ...) are, and so are the blocks such a layer runs itself
    (a SpatialTransformer's transformer blocks).  Compiling block by block keeps compile time to
    one trace per block class and shape, where a whole-model trace would unroll the loop.  The
    compiled function replaces the block's ``forward`` (instance attribute) only while installed,
    so the module objects, their types and the model's own iteration stay as they are.
    Weight-holding layers (Linear, Conv) are made opaque with ``torch.compiler.disable``: the lean
    kernels and the stock fallback run as they are (a quantized weight is a tensor subclass the
    compiler cannot trace, and a GEMM gains nothing from tracing)."""

    def __init__(self, diffusion_model, tol: float = 0.02, max_tol: float = 0.25):
        self.tol, self.max_tol = tol, max_tol
        self.enabled, self.reason = True, None
        self.checks: list = []  # one dict per validated input signature
        self.regions = [m for m in _block_regions(diffusion_model) if not isinstance(m, _WEIGHT_LAYERS)]
        self.opaque = [m for m in diffusion_model.modules() if isinstance(m, _WEIGHT_LAYERS)]
        self._wrappers: dict = {}
        if not self.regions:
            self.enabled, self.reason = False, "no blocks (nn.ModuleList) to compile"
            return
        # Dynamo keeps one cache entry per code object, shape and guard set.  The opaque layers
        # break the graph, so the frames that call them (a UNet's transformer block, its
        # attention) are compiled on their own; ComfyUI's per-block keys are kept out of them
        # (_region_forward), but a model passing other per-block constants would still need one
        # entry per module instance.  Past the limit Dynamo silently runs the frame eager -
        # measured on SDXL (70 transformer blocks, limit 41): part of the model lost its fusion.
        cfg = torch._dynamo.config
        per_class = collections.Counter(type(m) for r in self.regions for m in r.modules()
                                        if not isinstance(m, _WEIGHT_LAYERS))
        limit = max(8, len(self.regions), max(per_class.values(), default=0)) + 8
        wanted = {"recompile_limit": limit, "cache_size_limit": limit,
                  "accumulated_recompile_limit": max(256, 4 * sum(per_class.values()))}
        for name, value in wanted.items():
            if hasattr(cfg, name) and getattr(cfg, name) < value:
                setattr(cfg, name, value)
        self.compiled = [self._region_forward(m, torch.compile(m.forward, dynamic=False)) for m in self.regions]

    @staticmethod
    def _region_forward(m, compiled):
        """What a region runs while installed: its compiled forward, called without the per-block
        keys of transformer_options.  ComfyUI hands every block its own ``block`` /
        ``block_index`` for patch lookups; compiled code guards on such constants, so Dynamo
        kept one compiled variant per block (70 for SDXL's transformer block) and scanned them on
        every call.  Without patches (graphs are never captured with patches) the keys change
        nothing, so they are left out; with patches the eager forward runs, and with a callable
        in the options (an attention override might read the index) they are kept.  Opaque to
        an enclosing compiled region (a SpatialTransformer calling its blocks)."""
        # passed by keyword (blocks) or by position (a UNet's SpatialTransformer: layer(x, context, options))
        position = _options_position(m)
        if position is None:
            return compiled
        eager = m.forward

        def forward(*args, **kwargs):
            by_position = "transformer_options" not in kwargs and len(args) > position
            topts = args[position] if by_position else kwargs.get("transformer_options")
            if isinstance(topts, dict) and any(k in topts for k in _PER_BLOCK_KEYS):
                if _carried_patches(topts):
                    return eager(*args, **kwargs)
                if any(callable(v) for v in topts.values()):
                    # e.g. an optimized_attention_override, which may read the block's index:
                    # compiled as it is (one variant per block, but the same behaviour)
                    return compiled(*args, **kwargs)
                topts = {k: v for k, v in topts.items() if k not in _PER_BLOCK_KEYS}
                if by_position:
                    args = (*args[:position], topts, *args[position + 1:])
                else:
                    kwargs["transformer_options"] = topts
            return compiled(*args, **kwargs)
        return torch.compiler.disable(forward)

    def installed(self):
        blocks = self

        class _Swap:
            def __enter__(self):
                self.mods = blocks.regions + blocks.opaque
                self.saved = [m.__dict__.get("forward") for m in self.mods]
                for m, c in zip(blocks.regions, blocks.compiled):
                    m.forward = c
                for m, f in zip(blocks.opaque, self.saved[len(blocks.regions):]):
                    m.forward = blocks._opaque_forward(m, f)
                return self

            def __exit__(self, *exc):
                for m, f in zip(self.mods, self.saved):
                    if f is None:
                        del m.forward
                    else:
                        m.forward = f
                return False
        return _Swap()

    def _opaque_forward(self, m, own):
        """The module's (lean or stock) forward hidden from Dynamo; the same wrapper object each
        time, so the compiled code's guards keep matching."""
        cached = self._wrappers.get(id(m))
        if cached is None or cached[0] is not own:
            cached = (own, torch.compiler.disable(m.forward))
            self._wrappers[id(m)] = cached
        return cached[1]

    def validate(self, run, ref, perturbed=None) -> bool:
        """Run the compiled blocks once (compiling them) and compare with the eager ``ref``.

        Fused kernels round differently (fp32 inside a fused norm, ...), and through a deep
        network - more so one with quantized activations, where a rounding flip moves a value by
        a whole quantization step - that grows well beyond one rounding.  So the allowed
        difference is measured, not guessed: ``perturbed()`` runs the eager model on the input
        rounded once more (relative noise of half the dtype's epsilon), and the compiled output
        may differ from ``ref`` by at most 3x that (at least ``tol``, never more than
        ``max_tol``).  A miscompilation shows up as a far larger difference."""
        if not self.enabled:
            return False
        logging.info(f"[comfy-modelopt] compiling {len(self.regions)} blocks for a new input shape "
                     "(once per shape; Flux-size models take ~30 s) and checking them against eager")
        try:
            with self.installed():
                out = run()
        except Exception as e:  # an untraceable block, a compiler error: stay eager
            return self._disable(f"compile failed: {type(e).__name__}: {str(e)[:200]}")
        err = _rel_l2(out, ref)
        noise = _rel_l2(perturbed(), ref) if perturbed is not None else 0.0
        limit = min(self.max_tol, max(self.tol, 3.0 * noise))
        self.checks.append({"rel_l2": err, "eager_rounding_noise": noise, "limit": limit})
        if not err <= limit:  # also catches NaN
            return self._disable(f"compiled output differs from eager by {err:.4f} (relative L2; allowed "
                                 f"{limit:.4f} = 3x eager's own rounding noise {noise:.4f}, at least {self.tol})")
        logging.info(f"[comfy-modelopt] compiled blocks: {len(self.regions)} regions, relative L2 vs eager "
                     f"{err:.2e} (eager rounding noise {noise:.2e})")
        return True

    def _disable(self, reason: str) -> bool:
        self.enabled, self.reason = False, reason
        logging.warning(f"[comfy-modelopt] compiled blocks turned off: {reason}")
        return False


def _carried_patches(topts: dict) -> str | None:
    """Which patch kind transformer_options carry (they run inside the blocks), else None."""
    return next((key for key in ("patches", "patches_replace") if _nonempty(topts.get(key))), None)


def _nonempty(v) -> bool:
    if isinstance(v, dict):
        return any(_nonempty(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_nonempty(x) for x in v) if v and isinstance(v[0], (dict, list, tuple)) else bool(v)
    return bool(v)


def _clone_tree(v, device):
    """Static copies of every tensor in ``v``, on ``device``."""
    if isinstance(v, torch.Tensor):
        return v.to(device, copy=True)
    if isinstance(v, dict):
        return {k: _clone_tree(x, device) for k, x in v.items()}
    if isinstance(v, list):
        return [_clone_tree(x, device) for x in v]
    if isinstance(v, tuple):
        return tuple(_clone_tree(x, device) for x in v)
    return v


def _tensors(*trees) -> list:
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    for t in trees:
        walk(t)
    return out


# ====================================================================== int8 attention
def int8_attention_available(device) -> bool:
    try:
        import comfy_kitchen as ck
        return bool(ck.int8_attention_is_available(torch.device(device)))
    except (ImportError, AttributeError, RuntimeError):
        return False


def int8_attention_override(func, *args, **kwargs):
    """``optimized_attention_override``: kitchen's INT8 attention (SageAttention-style, Hadamard-
    rotated Q/K) for unmasked 64/128/256-dim heads on CUDA; anything else goes to ComfyUI's choice."""
    import comfy_kitchen as ck
    q, k, v, heads = args[:4]
    mask = kwargs.get("mask", args[4] if len(args) > 4 else None)
    if mask is not None or q.device.type != "cuda" or kwargs.get("enable_gqa") or \
            q.dtype not in (torch.float16, torch.bfloat16):
        return func(*args, **kwargs)
    if kwargs.get("skip_reshape", False):
        b, _, _, d = q.shape
    else:
        b, _, hd = q.shape
        d = hd // heads
        q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    if d not in (64, 128, 256):
        return func(*args, **kwargs)
    out = ck.int8_attention(q, k, v, scale=kwargs.get("scale"))
    if not kwargs.get("skip_output_reshape", False):
        out = out.transpose(1, 2).reshape(b, -1, heads * d)
    return out


def enable_int8_attention(patcher):
    """A clone of ``patcher`` whose attention runs kitchen's INT8 kernel where it applies."""
    if not int8_attention_available(patcher.load_device):
        raise ValueError("kitchen's INT8 attention kernel is not available on this device")
    clone = patcher.clone()
    topts = clone.model_options.setdefault("transformer_options", {})
    if "optimized_attention_override" in topts:
        raise ValueError("this MODEL already overrides attention")
    topts["optimized_attention_override"] = int8_attention_override
    return clone


def enable_cuda_graphs(patcher, compile_blocks: bool = False):
    """A clone of ``patcher`` whose model evaluations are captured and replayed (over
    Inductor-compiled blocks with ``compile_blocks``, validated against eager)."""
    clone = patcher.clone()
    existing = clone.model_options.get("model_function_wrapper")
    if existing is not None:
        raise ValueError("this MODEL already has a model function wrapper; CUDA graphs would bypass it")
    runner = CudaGraphs(clone, compile_blocks=compile_blocks)
    clone.set_model_unet_function_wrapper(runner)
    clone.add_callback_with_key(CallbacksMP.ON_CLEANUP, "comfy_modelopt_cuda_graphs", runner.release)
    clone.add_callback_with_key(CallbacksMP.ON_DETACH, "comfy_modelopt_cuda_graphs", runner.release)
    return clone, runner
