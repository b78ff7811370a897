"""Compiled blocks: the repeated transformer blocks of a model compiled by TorchInductor, for
use under CUDA-graph capture (``cuda_graphs``).  Design: docs/design.md, ``comfyui/compiled_blocks.py``.
"""
from __future__ import annotations

import collections
import inspect
import logging
import threading
import time

import torch

from ..device_constants import ConstantsOnDevice, HostCopies
from .patch_lookups import PATCH_KEYS, call_with, carried_patches, hits, leaves, watched


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def rounding_noise(x, dtype=None):
    """``x`` with relative noise of half the epsilon of ``dtype`` (the model's compute dtype;
    default ``x``'s own): one more rounding to that dtype, reproducibly."""
    g = torch.Generator(device=x.device).manual_seed(0)
    noise = torch.randn(x.shape, generator=g, device=x.device, dtype=torch.float32)
    eps = torch.finfo(dtype or x.dtype).eps
    return (x.float() * (1 + noise * (eps / 2))).to(x.dtype)


def latent_shapes(values) -> tuple:
    """What the blocks' shapes follow in a model call's ``values`` (its arguments less ControlNet
    residuals and options): the shapes of its tensors of two or more dimensions - the latent, the
    text conditioning, reference latents."""
    if isinstance(values, torch.Tensor):
        return (tuple(values.shape),) if values.dim() >= 2 else ()
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else ()
    return tuple(sorted(s for v in items for s in latent_shapes(v)))


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


_WEIGHT_LAYERS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
_WEIGHT_LAYER_NAMES = {"Linear", "Conv1d", "Conv2d", "Conv3d"}


def _is_weight_layer(m) -> bool:
    """A Linear or convolution - including ComfyUI's quantized ``MixedPrecisionOps.Linear``, which
    derives from ``nn.Module`` only: missed, Dynamo traced into the lean fp8 forward, broke its
    graph at the kernel call and compiled that chain once per layer shape (60 compilations for
    Flux, most of a warm-cache first run)."""
    return isinstance(m, _WEIGHT_LAYERS) or (type(m).__name__ in _WEIGHT_LAYER_NAMES and
                                             isinstance(getattr(m, "weight", None), torch.Tensor))


# what a region is called without (unless the options carry patches or callables): the per-block
# constants ComfyUI sets for patch lookups, and the sampler's whole sigma schedule - no block reads
# it (the models that do read it at the top level), but compiled code guarded on its length, so
# blocks compiled ahead from an 8-step calibration compiled again at a 20-step image
_KEYS_LEFT_OUT = ("block", "block_index", "transformer_index", "sample_sigmas")


def own(fn):
    """Marks a callable of this pack that it puts in transformer_options (an attention override):
    not foreign to the graphs (``cuda_graphs`` checks other packs' callables against eager once)."""
    fn.comfy_modelopt_own = True
    return fn


def block_independent(fn):
    """Marks a callable of the options (an attention override) that reads none of the per-block
    keys in ``_KEYS_LEFT_OUT``: regions are then called without those keys, as without a callable
    (else compiled code keeps one variant per block and guards on the sigma schedule's length)."""
    fn.block_independent = True
    return fn


class CompiledBlocks:
    """TorchInductor-compiled forwards of a model's blocks, installed on demand.

    Regions are the elements of every ``nn.ModuleList`` under the diffusion model (Flux's
    double/single blocks, DiT blocks) - for an ``nn.Sequential`` the model iterates itself (a UNet's
    ``TimestepEmbedSequential``) its layers, and the blocks such a layer runs itself (a
    SpatialTransformer's): one trace per block class and shape, where a whole-model trace would
    unroll the loop.  The compiled function is the block's ``forward`` (instance attribute) only
    while installed.  A weight-holding layer whose forward is a plain kernel call is one operator in
    the block's graph (``traced_layers``; a graph break there kept tensors alive across the block),
    any other is opaque (``torch.compiler.disable``): a quantized weight is a tensor subclass the
    compiler cannot trace, and a GEMM gains nothing from tracing."""

    def __init__(self, diffusion_model, tol: float = 0.02, max_tol: float = 0.25, trace_layers: bool = True):
        self.tol, self.max_tol = tol, max_tol
        # plain kernel calls as operators, not breaks (traced_layers: ComfyUI's, imported here)
        if trace_layers:
            from . import traced_layers
        self.traced = traced_layers if trace_layers else None
        # compile the regions for inputs they have no code for (False: such a region runs eagerly -
        # a new image size costs no compilation; compile_for compiles all the same)
        self.compile_new_shapes = True
        self.enabled, self.reason = True, None
        self.checks: list = []  # one dict per validated input signature
        self.shapes: set = set()  # the ``latent_shapes`` compiled for (ahead, or in the background)
        self.landed = 0  # background compilations that compiled new code (``background_compile``)
        self.regions = [m for m in _block_regions(diffusion_model) if not _is_weight_layer(m)]
        self.opaque = [m for m in diffusion_model.modules() if _is_weight_layer(m)]
        self._wrappers: dict = {}
        self._lookups: dict = {}  # (id(region), its per-block keys) -> what its code looks up in the patches
        self.patched_calls = 0  # region calls run eagerly because a patch applies inside
        # installed for one thread at a time (``installed``): a region called from any other
        # thread (another workflow's sampler in the same process) runs eagerly
        self._owner = None
        self._lock = threading.Lock()
        if not self.regions:
            self.enabled, self.reason = False, "no blocks (nn.ModuleList) to compile"
            return
        # Dynamo keeps one cache entry per code object, shape and guard set.  Opaque layers (a
        # cast or patched convolution, anything not traced as an operator) break the graph, so
        # the frames that call them (a UNet's blocks, their attention) are compiled on their own;
        # ComfyUI's per-block keys are kept out of them (_region_forward), but a model passing
        # other per-block constants would still need one entry per module instance.  Past the
        # limit Dynamo silently runs the frame eager - measured on SDXL (70 transformer blocks,
        # limit 41): part of the model lost its fusion.
        cfg = torch._dynamo.config
        per_class = collections.Counter(type(m) for r in self.regions for m in r.modules()
                                        if not _is_weight_layer(m))
        limit = max(8, len(self.regions), max(per_class.values(), default=0)) + 8
        wanted = {"recompile_limit": limit, "cache_size_limit": limit,
                  "accumulated_recompile_limit": max(256, 4 * sum(per_class.values()))}
        for name, value in wanted.items():
            if hasattr(cfg, name) and getattr(cfg, name) < value:
                setattr(cfg, name, value)
        self.compiled = [self._region_forward(m, torch.compile(m.forward, dynamic=False)) for m in self.regions]

    def _region_forward(self, m, compiled):
        """What a region runs while installed: its compiled forward, called without the patches
        and the keys in ``_KEYS_LEFT_OUT`` - or its eager forward where a patch applies inside it.

        Which patches a region looks up is learnt at its first call with patches (run eagerly,
        the patch dicts watched: ``patch_lookups``).  A region none of whose lookups hits runs
        compiled, blind to the patches (a FreeU block patch acts between regions); one where a
        lookup hits runs eagerly (a PAG or IP-Adapter attention replace on that block).
        ComfyUI's per-block keys (``block``, ``block_index``, ``sample_sigmas``) would make Dynamo
        keep one variant per block and scan them all on every call: without an applying patch
        they change nothing and are left out - kept where a callable in the options (an attention
        override) might read them.  Opaque to an enclosing compiled region."""
        # passed by keyword (blocks) or by position (a UNet's SpatialTransformer: layer(x, context, options))
        position = _options_position(m)
        eager = m.forward
        blocks = self
        compiled = _without_capture_mode(compiled)

        def forward(*args, **kwargs):
            if blocks._owner != threading.get_ident():
                return eager(*args, **kwargs)
            if position is None:
                return compiled(*args, **kwargs)
            by_position = "transformer_options" not in kwargs and len(args) > position
            topts = args[position] if by_position else kwargs.get("transformer_options")
            if not isinstance(topts, dict):
                return compiled(*args, **kwargs)

            def with_options(options):
                if by_position:
                    return (*args[:position], options, *args[position + 1:]), kwargs
                return args, {**kwargs, "transformer_options": options}
            if carried_patches(topts):
                # learnt per region, per block keys and per kinds of patches present: code that
                # never saw a kind (no "patches_replace" at all) recorded no lookup in it
                where = (id(m), *(repr(dict.get(topts, k)) for k in _KEYS_LEFT_OUT[:3]),
                         *(tuple(sorted(map(str, dict.keys(v)))) if isinstance(v := dict.get(topts, k), dict) else None
                           for k in PATCH_KEYS))
                lookups = blocks._lookups.get(where)
                if lookups is None:  # learnt at the region's first call with patches (here), run eagerly
                    seen = set()
                    out = call_with(eager, with_options(watched(topts, seen)))
                    blocks._lookups[where] = leaves(seen)
                    return out
                if hits(lookups, topts):
                    blocks.patched_calls += 1
                    return eager(*args, **kwargs)
            drop = [k for k in (*PATCH_KEYS, *_KEYS_LEFT_OUT) if k in topts]
            if not drop:
                return compiled(*args, **kwargs)
            if any(callable(v) and not getattr(v, "block_independent", False) for v in topts.values()):
                # e.g. another pack's optimized_attention_override, which may read the block's
                # index: compiled with the keys (one variant per block, but the same behaviour)
                drop = [k for k in drop if k in PATCH_KEYS]
            return call_with(compiled, with_options({k: v for k, v in topts.items() if k not in drop}))
        return torch.compiler.disable(forward)

    def installed(self, compile_new_shapes: bool | None = None):
        """A context in which the regions run compiled - for the calling thread only (another
        thread calling a region meanwhile runs it eagerly); one thread at a time.
        ``compile_new_shapes`` (default: the blocks' own ``compile_new_shapes``): False - a region
        with no code compiled for its inputs runs eagerly instead of compiling (torch's
        "eager_on_recompile" stance, process-wide while installed)."""
        blocks = self
        stance = not (self.compile_new_shapes if compile_new_shapes is None else compile_new_shapes)

        class _Swap:
            def __enter__(self):
                blocks._lock.acquire()
                self.stance = torch.compiler.set_stance("eager_on_recompile") if stance else None
                if self.stance is not None:
                    self.stance.__enter__()
                blocks._owner = threading.get_ident()
                self.mods = blocks.regions + blocks.opaque
                self.saved = [m.__dict__.get("forward") for m in self.mods]
                for m, c in zip(blocks.regions, blocks.compiled):
                    m.forward = c
                for m, f in zip(blocks.opaque, self.saved[len(blocks.regions):]):
                    opaque = blocks._opaque_forward(m, f)
                    # a plain kernel call is one operator in the block's graph, not a break
                    m.forward = (blocks.traced.traced_forward(m, opaque) if blocks.traced else None) or opaque
                return self

            def __exit__(self, *exc):
                for m in blocks.opaque if blocks.traced else ():
                    blocks.traced.clear(m)
                for m, f in zip(self.mods, self.saved):
                    if f is None:
                        del m.forward
                    else:
                        m.forward = f
                blocks._owner = None
                if self.stance is not None:
                    self.stance.__exit__(None, None, None)
                blocks._lock.release()
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

    def validate(self, run, ref, perturbed=None, compile_new_shapes: bool | None = None, fail=None) -> bool:
        """Run the compiled blocks once (compiling them) and compare with the eager ``ref`` (None:
        compile only, on weights whose values mean nothing; no signature counts as checked by it).

        Fused kernels round differently, and through a deep network with quantized activations
        that grows well beyond one rounding, so the allowed difference is measured: ``perturbed()``
        runs the eager model on the input rounded once more, and the compiled output may differ
        from ``ref`` by 3x that (within [``tol``, ``max_tol``]).  A miscompilation differs far more.
        ``fail(reason)`` (default ``disable``) answers a failed compilation or check."""
        fail = fail or self.disable
        if not self.enabled:
            return False
        before = compile_account()
        compiles = self.compile_new_shapes if compile_new_shapes is None else compile_new_shapes
        logging.info(f"[comfy-modelopt] {'compiling' if ref is None else 'checking'} {len(self.regions)} compiled "
                     f"blocks {'on placeholder weights' if ref is None else 'against eager'} for a new input "
                     "signature (" + ("compiling them unless already compiled for its shapes: once per shape and "
                                      "process, tens of seconds with a cold compile cache)" if compiles else
                                      "nothing is compiled: a region with no code for these shapes runs eagerly)"))
        t0 = time.perf_counter()
        try:
            with self.installed(compiles):
                out = run()
        except Exception as e:  # an untraceable block, a compiler error: stay eager
            return fail(f"compile failed: {type(e).__name__}: {str(e)[:200]}")
        seconds, spent = time.perf_counter() - t0, compile_account(before)
        compiled = spent.pop("frames")
        check = {"rel_l2": None, "frames_compiled": compiled, "seconds": round(seconds, 3), "compile": spent}
        self.checks.append(check)
        done = (f"[comfy-modelopt] compiled blocks: {len(self.regions)} regions, {compiled} frames compiled in "
                f"{seconds:.1f} s{_account_text(spent) if compiled else ''}")
        if ref is None:
            logging.info(f"{done} on placeholder weights (checked against eager at the first image)")
            return True
        err = rel_l2(out, ref)
        noise = rel_l2(perturbed(), ref) if perturbed is not None else 0.0
        limit = min(self.max_tol, max(self.tol, 3.0 * noise))
        check.update(rel_l2=err, eager_rounding_noise=noise, limit=limit)
        if not err <= limit:  # also catches NaN
            return fail(f"compiled output differs from eager by {err:.4f} (relative L2; allowed "
                                 f"{limit:.4f} = 3x eager's own rounding noise {noise:.4f}, at least {self.tol})")
        logging.info(f"{done}, relative L2 vs eager {err:.2e} (eager rounding noise {noise:.2e})")
        return True

    def compile_for(self, call, diffusion_model, device, dtype=None, options=None, may_stream=None,
                    check: bool = True) -> bool:
        """Compile the blocks for the shapes of ``call`` (``calls.RecordedCall``: the diffusion
        model's first call while calibrating, replayed on ``device``) and check them against eager,
        before any image (the first image then finds them compiled).  The call is made as the
        sampler will make it: in the compute ``dtype``, the MODEL's transformer ``options`` merged
        in first as ComfyUI's sampler merges them.

        ``may_stream()`` (dynamic VRAM): True when the model is not wholly on the GPU after the
        first evaluation.  Then the perturbed evaluation must not copy weights from the CPU: a
        model streamed at every evaluation cannot be captured, so compiling would only cost time.

        ``check=False`` (the weights are placeholders, ``runtime.borrowed_on``): compiled, not
        compared with eager - the first evaluation on the real weights checks them."""
        if dtype is not None:  # BaseModel._apply_model casts the latent and every conditioning
            # tensor but ints and longs; the timestep stays float32
            call = call.cast(dtype, positions=(0,), skip=("control", "transformer_options"))
        recorded = call.kwargs.get("transformer_options")
        if options and isinstance(recorded, dict):
            merged = {**options, **{k: v for k, v in recorded.items() if k not in options}}
            call = type(call)(call.args, {**call.kwargs, "transformer_options": merged})

        def run(first_tensor=None, fn=diffusion_model):
            return call.replay(fn, device, first_tensor)

        def perturbed():
            return run(lambda x: rounding_noise(x, dtype))
        # the first evaluation: a dynamic model's weights are paged in here
        ref = run(fn=lambda *a, **k: (self.shapes.add(latent_shapes((a, {n: v for n, v in k.items() if n not in (
            "control", "transformer_options")}))), diffusion_model(*a, **k))[1])
        if not check:  # compiled after that eager call all the same, as a checked compile is
            return self.validate(run, None, compile_new_shapes=True)
        if may_stream is not None and may_stream():
            def checked(*args, **kwargs):  # as the CUDA-graph warm-up checks its forward
                with HostCopies() as copies, ConstantsOnDevice():
                    out = diffusion_model(*args, **kwargs)
                if copies.bytes >= STREAMED_BYTES:
                    raise _Streams()
                return out
            try:
                noisy = run(lambda x: rounding_noise(x, dtype), checked)
            except _Streams:
                return self.disable("the model's weights are copied from the CPU at every evaluation (it does not fit "
                                    "in the GPU's free memory, so ComfyUI streams them): no CUDA graph can capture that "
                                    "- it runs as ComfyUI runs it")
            perturbed = lambda: noisy  # noqa: E731
        return self.validate(run, ref, perturbed, compile_new_shapes=True)

    def disable(self, reason: str) -> bool:
        self.enabled, self.reason = False, reason
        logging.warning(f"[comfy-modelopt] compiled blocks turned off: {reason}")
        return False


# what a compilation's time went to (torch._dynamo's own timers, in seconds; a name this torch does not time
# is left out) and how its compile caches answered
_TIMERS = {"_compile.compile_inner": "compiling", "bytecode_tracing": "tracing",
           "OutputGraph.call_user_compiler": "backend", "build_guards": "guards"}
_CACHES = {("aot_autograd", "autograd_cache_hit"): "aot_hits", ("aot_autograd", "autograd_cache_miss"): "aot_misses",
           ("inductor", "fxgraph_cache_hit"): "inductor_hits", ("inductor", "fxgraph_cache_miss"): "inductor_misses"}


def compile_account(since: dict | None = None) -> dict:
    """Frames compiled, the compile caches' hits and misses and the seconds in each compile phase
    so far in this process (``since``: less that earlier account)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    now = {"frames": counters["frames"]["ok"], **{v: counters[a][b] for (a, b), v in _CACHES.items()},
           **{v: round(sum(compilation_time_metrics[k]), 3) for k, v in _TIMERS.items() if k in compilation_time_metrics}}
    return now if since is None else {k: round(v - since.get(k, 0), 3) for k, v in now.items()}


def _account_text(spent: dict) -> str:
    phases = ", ".join(f"{k} {spent[k]:.1f} s" for k in _TIMERS.values() if k in spent)
    caches = (f"AOT cache {spent['aot_hits']:g} hits / {spent['aot_misses']:g} misses, Inductor cache "
              f"{spent['inductor_hits']:g} / {spent['inductor_misses']:g}")
    return f" ({phases}; {caches})" if phases else f" ({caches})"


# what an evaluation may copy from the CPU before its model counts as streamed: far above any input
# or constant a model builds on the host, below one page of ComfyUI's dynamic VRAM (32 MiB) times two
STREAMED_BYTES = 64 << 20


class _Streams(Exception):
    """An evaluation copied weights from the CPU (``compile_for``)."""


def _without_capture_mode(compiled):
    """``compiled`` called with a capture's ``ConstantsOnDevice`` mode left for the call: Dynamo
    guards on the torch-function mode stack, so a region compiled without it (a warm-up run
    outside that mode) would be recompiled inside the capture.  The blocks build no CPU constants."""
    def call(*args, **kwargs):
        if isinstance(torch.overrides._get_current_function_mode(), ConstantsOnDevice):
            with torch.overrides._pop_mode_temporarily():
                return compiled(*args, **kwargs)
        return compiled(*args, **kwargs)
    return call
