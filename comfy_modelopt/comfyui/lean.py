"""Lean runtime: the same quantized layers and kernels as stock ComfyUI, without its per-call
Python dispatch, plus CUDA-graph replay of whole model evaluations.

``make_lean(patcher)`` rebinds the forward of every quantized ``MixedPrecisionOps.Linear`` of a
model *we created* (Quantize Model / Load Quantized Model output) to a direct call of the kernel
the stock path ends in:

- fp8 with a static input scale: kitchen's fused activation quantizer + ``scaled_mm`` (bit-exact
  with stock; ``fast_accum`` trades exactness for Hopper's fast fp8 accumulation);
- int8 / int8+ConvRot: kitchen's ``int8_linear`` op (what the stock dispatch calls);
- formats this GPU cannot compute (nvfp4/mxfp8 before Blackwell, fp8 weight-only, ...): kitchen's
  dequantization kernel + one 16-bit GEMM, as stock does.

Whenever a layer is offloaded, patched by a LoRA at run time (weight functions), or holds a
16-bit weight, the stock forward runs instead.  ``CudaGraphs`` (installed as a model-function
wrapper on a clone, so it works for 16-bit models too) captures each distinct input signature
once and replays it; anything it cannot capture runs eagerly with the reason logged.
"""
from __future__ import annotations

import logging
import types

import torch

import comfy.model_management

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


def _dequant_forward(module, x):
    return torch.nn.functional.linear(x, module.weight.dequantize().to(x.dtype), _bias(module, x))


def make_lean(patcher, fast_accum: bool = False) -> int:
    """Rebind quantized Linear forwards of ``patcher``'s own model; returns how many."""
    device = patcher.load_device
    native = _native_formats(device)
    count = 0
    for module in patcher.model.diffusion_model.modules():
        fmt = getattr(module, "quant_format", None)
        if fmt is None or getattr(module, "_modelopt_lean", False):
            continue
        # own-loader layers wrap their base forward: make that one lean, keep the wrapper
        attr = "_modelopt_base_forward" if hasattr(module, "_modelopt_base_forward") else "forward"
        stock = getattr(module, attr)
        full_precision = module._full_precision_mm or fmt not in native
        if fmt in _FP8 and not full_precision and getattr(module, "input_scale", None) is not None:
            fast = lambda m, x, fa=fast_accum: _fp8_forward(m, x, fa)  # noqa: E731
        elif fmt == "int8_tensorwise" and not full_precision:
            fast = _int8_forward
        elif full_precision:
            fast = _dequant_forward
        else:
            continue  # natively computed formats without a lean path (e.g. nvfp4 on Blackwell)

        def forward(self, input, *args, _fast=fast, _stock=stock, **kwargs):
            if _fast_path_ok(self, input):
                return _fast(self, input)
            return _stock(input, *args, **kwargs)
        setattr(module, attr, types.MethodType(forward, module))
        module._modelopt_lean = True
        count += 1
    return count


# ====================================================================== CUDA graphs
class CudaGraphs:
    """Model-function wrapper: capture ``apply_model`` per input signature, then replay.

    A signature is the shapes/dtypes of every tensor argument plus the non-tensor values; the
    weights' storage addresses are checked before each replay (a model unloaded and reloaded
    elsewhere is captured again).  Runs eagerly, logging why, when the model is partially
    loaded, when transformer options carry patches, or when capture fails."""

    def __init__(self, patcher, max_graphs: int = 8):
        self.patcher, self.max_graphs = patcher, max_graphs
        self.graphs: dict = {}
        self.pool = None
        self.warned: set = set()
        self.eager_calls = self.replays = self.captures = 0

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

    def _weights_key(self):
        model = self.patcher.model
        return (getattr(model, "current_weight_patches_uuid", None),
                tuple(p.data_ptr() for p in model.diffusion_model.parameters()))

    def _blocker(self, args) -> str | None:
        x = args["input"]
        if x.device.type != "cuda":
            return "not on a CUDA device"
        model = self.patcher.model
        if getattr(model, "model_lowvram", False) or getattr(model, "lowvram_patch_counter", 0):
            return "model partially loaded (offloading)"
        topts = args["c"].get("transformer_options", {})
        for key in ("patches", "patches_replace", "wrappers", "callbacks"):
            if _nonempty(topts.get(key)):
                return f"transformer_options carries {key}"
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
                entry = self._capture(apply_model, args, c, topts, weights)
            except Exception as e:  # capture can fail on host syncs or unsupported ops
                self.graphs.pop(sig, None)
                return self._eager(apply_model, args, f"capture failed: {type(e).__name__}: {str(e)[:120]}")
            self.graphs[sig] = entry
            return entry["out"].clone()
        for dst, src in zip(entry["static"], _tensors(args["input"], args["timestep"], c)):
            dst.copy_(src, non_blocking=True)
        entry["graph"].replay()
        self.replays += 1
        return entry["out"].clone()

    def _capture(self, apply_model, args, c, topts, weights):
        static_x = args["input"].clone()
        static_t = args["timestep"].clone()
        static_c = _clone_tree(c)
        static_c["transformer_options"] = topts
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (lazy inits, autotuning)
            apply_model(static_x, static_t, **static_c)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = apply_model(static_x, static_t, **static_c)
        self.captures += 1
        graph.replay()
        static_c.pop("transformer_options")
        return {"graph": graph, "static": _tensors(static_x, static_t, static_c), "out": out, "weights": weights}


def _nonempty(v) -> bool:
    if isinstance(v, dict):
        return any(_nonempty(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_nonempty(x) for x in v) if v and isinstance(v[0], (dict, list, tuple)) else bool(v)
    return bool(v)


def _clone_tree(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clone_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clone_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_clone_tree(x) for x in v)
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


def enable_cuda_graphs(patcher):
    """A clone of ``patcher`` whose model evaluations are captured and replayed."""
    clone = patcher.clone()
    existing = clone.model_options.get("model_function_wrapper")
    if existing is not None:
        raise ValueError("this MODEL already has a model function wrapper; CUDA graphs would bypass it")
    runner = CudaGraphs(clone)
    clone.set_model_unet_function_wrapper(runner)
    return clone, runner
