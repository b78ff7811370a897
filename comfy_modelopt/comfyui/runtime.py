"""The runtimes a quantized MODEL can run under, as the nodes and benchmarks offer them.
Design: docs/design.md, ``comfyui/runtime.py``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import comfy.model_management
import comfy.model_patcher
from comfy.patcher_extension import CallbacksMP, WrappersMP

from .. import w4a8
from ..formats import FORMATS
from . import compile_cache
from .attention import ATTENTIONS
from .compiled_blocks import STREAMED_BYTES
from .control_graphs import ControlGraphs, mend_control_loras
from .cuda_graphs import CudaGraphs
from .kernels import W4A8Kernel
from .lean import dequant_cache_of, make_lean, native_formats, release_on_detach
from .model import compute_device


@dataclass(frozen=True)
class Runtime:
    label: str                     # what the nodes' combo shows
    lean: bool = True              # direct kernel calls for the quantized layers
    cuda_graphs: bool = False      # capture and replay whole model evaluations
    compiled_blocks: bool = False  # ... over TorchInductor-compiled blocks
    attention: str = ""            # 8-bit attention (attention.ATTENTIONS: "int8", "fp8"; changes its numerics)
    ahead_only: bool = False       # compiled blocks only where they compile before the first image
    attention_optional: bool = False  # the 8-bit attention only where it runs (else left out, with why)


AUTO = "auto"
RUNTIMES = {r.label: r for r in (
    Runtime(AUTO, cuda_graphs=True, compiled_blocks=True, ahead_only=True, attention="fp8", attention_optional=True),
    Runtime("lean"),
    Runtime("lean + cuda graphs", cuda_graphs=True),
    Runtime("lean + compiled blocks + cuda graphs", cuda_graphs=True, compiled_blocks=True),
    Runtime("lean + cuda graphs + int8 attention", cuda_graphs=True, attention="int8"),
    Runtime("lean + cuda graphs + fp8 attention", cuda_graphs=True, attention="fp8"),
    Runtime("lean + compiled blocks + cuda graphs + fp8 attention", cuda_graphs=True, compiled_blocks=True,
            attention="fp8"),
    Runtime("stock", lean=False),
)}
# auto: graphs over compiled blocks where the blocks compile before the first image (Quantize Model
# with a calibration, Load Quantized Model on a calibrated file), else lean + graphs; FP8 attention
# where it runs (Hopper with fa3-fwd, self-attention of attention.FP8_MIN_TOKENS+ tokens).  Chosen
# by whole runs through the nodes: docs/benchmarks.md section 0.  Patches, ControlNets and wrappers
# run through the same graphs; another image size too, its blocks compiled after its first run, in
# the background (background_compile).
DEFAULT_RUNTIME = AUTO

RUNTIME_TOOLTIP = ("auto (default): the fastest measured - CUDA graphs over compiled blocks where they compile "
                   "here, else lean + cuda graphs; FP8 attention on Hopper with fa3-fwd. lean: stock kernels "
                   "without per-layer Python. stock: ComfyUI's own layers. Figures: docs/benchmarks.md.")


def runtime_tooltip() -> str:
    """The runtime input's tooltip, marked where the choices beyond lean cannot apply."""
    if torch.cuda.is_available():
        return RUNTIME_TOOLTIP
    return ("No CUDA GPU here: every choice but stock runs as lean (the rest need one). lean: stock kernels "
            "without per-layer Python. stock: ComfyUI's own layers. auto (default) picks per GPU.")


DEQUANT_CACHE_TOOLTIP = ("GiB of VRAM for 16-bit copies of the weights this GPU cannot compute natively "
                         "(nvfp4/mxfp8 before Blackwell): those layers then skip dequantizing on every call "
                         "(same output). 0 = off. ComfyUI is told to keep that much free; the copies go "
                         "when the model leaves the GPU. Needs a lean runtime.")


def runtime_of(label: str) -> Runtime:
    try:
        return RUNTIMES[label]
    except KeyError:
        raise ValueError(f"unknown runtime {label!r}; choose one of: {', '.join(RUNTIMES)}") from None


def apply_runtime(patcher, runtime: str | Runtime, dequant_cache_gib: float = 0.0,
                  force_attention: bool = False, first_call=None) -> tuple:
    """Install ``runtime`` on a model this pack created; returns (model, note).  The model is a
    clone where CUDA graphs or 8-bit attention need one; lean layers are rebound in place.
    INT8 attention is left out where it measured slower (``attention.SLOWER_ON``) unless
    ``force_attention`` (benchmarks).  ``first_call`` (``calls.RecordedCall``, the
    calibration's first model call): compiled blocks are compiled for its shapes here, on a
    CUDA GPU, so that the first image at those shapes does not pay the compilation."""
    rt = runtime if isinstance(runtime, Runtime) else runtime_of(runtime)
    # (every runtime: ComfyUI's Control-LoRA would copy the quantized layers' codes)
    patcher.remove_wrappers_with_key(WrappersMP.CALC_COND_BATCH, CONTROL_LORA_KEY)
    patcher.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, CONTROL_LORA_KEY, mend_control_loras)
    if not rt.lean:
        return patcher, "runtime: stock ComfyUI layers" + (
            " (dequant cache ignored: it needs a lean runtime)" if dequant_cache_gib > 0 else "")
    n = make_lean(patcher, dequant_cache_bytes=int(dequant_cache_gib * 2**30))
    note = f"runtime: lean ({n} quantized layers on direct kernel calls"
    w4 = W4A8Kernel.count(patcher.model.diffusion_model)
    note += (f"; {w4} 4-bit ones run W4A8 - 8-bit tensor cores on the 4-bit weights - for the shapes where it "
             "times faster than dequantizing)" if w4 else ")")
    if patcher.is_dynamic():  # ComfyUI pages each layer's weight in through its cast path: not lean
        note = (f"runtime: lean set on {n} quantized layers, but ComfyUI loads this model with dynamic VRAM "
                "(over half the GPU), whose weights its own layers page in - they run as stock ComfyUI runs them")
    cache = dequant_cache_of(patcher.model)
    if cache is not None:
        note += (f" + dequantized-weight cache of up to {cache.budget / 2**30:.2f} GiB" if cache.budget
                 else " (dequant cache unused: every layer runs natively on this GPU)")
    if rt.attention:
        what, enable, where = ATTENTIONS[rt.attention]
        try:
            patcher = enable(patcher, force=force_attention)
            note += f" + {what}{where}"
        except ValueError as e:
            note += f" ({what} {'left out' if rt.attention_optional else 'not enabled'}: {e})"
    if rt.cuda_graphs:
        compile_blocks, left_out = rt.compiled_blocks, None
        if rt.ahead_only:
            left_out = _why_not_ahead(first_call)
            compile_blocks = left_out is None
        patcher, runner = enable_cuda_graphs(patcher, compile_blocks=compile_blocks)
        if rt.ahead_only and runner.compiled is not None:  # what an image compiles costs more than it saves
            runner.compiled.compile_new_shapes = False
        if compute_device().type == "cuda":
            note += " + CUDA graph replay" + (" over compiled blocks" if compile_blocks else "")
            if runner.compiled is not None:
                note += _compile_ahead(patcher, runner, first_call)
            elif left_out:
                note += f" (compiled blocks left out: {left_out})"
        else:  # installed, and it runs the model eagerly: say so rather than promise replays
            note += " (CUDA graph replay: no CUDA GPU here, the model runs eagerly)"
    if rt.label == AUTO:
        note = note.replace("runtime:", "runtime (auto):", 1)
    return patcher, note


def first_call_of(info, name: str):
    """The calibration's first model call a comfy-modelopt file describes (``inspect_file``'s
    ``ours``; ``calls.RecordedCall.read``): what Load Quantized Model compiles the blocks
    ahead for, as Quantize Model does from the calibration itself.  None without one, or for one
    this loader refuses (logged)."""
    calibration = info.ours.get("calibration")
    signature = calibration.get("first_call") if isinstance(calibration, dict) else None
    if signature is None:
        return None
    from ..calls import RecordedCall
    return RecordedCall.read(signature, name)


def _why_not_ahead(first_call) -> str | None:
    """Why compiled blocks cannot be compiled before the first image here, or None."""
    if compute_device().type != "cuda":
        return "no CUDA GPU"
    from torch.utils._triton import has_triton
    if not has_triton():
        return "Triton is not installed (TorchInductor needs it on a GPU)"
    if first_call is None:
        return ("no calibration to compile them ahead from, and compiling at the first image makes it slower "
                "than this runtime's whole first image; choose 'lean + compiled blocks + cuda graphs' for the "
                "faster later images")
    return None


def _compile_ahead(patcher, runner, first_call) -> str:
    """Compile the blocks at the calibration's shapes now, on the GPU (on placeholder weights
    there, ``borrowed_on``: the sampler's first evaluation checks them against eager on the real
    weights, as it checks every new signature); returns what the note should add.  Without a
    recorded call the first evaluation of each shape compiles them."""
    if not runner.compiled.enabled:
        return f" (compiled blocks off: {runner.compiled.reason})"
    if first_call is None:
        return " (the blocks compile at the first image of each size: no calibration to compile ahead from)"
    t0 = time.perf_counter()
    dm, dtype = patcher.model.diffusion_model, runner.compute_dtype()
    try:
        with compile_cache.kept(compile_cache.key_of(dm, first_call.signature(), dtype, patcher.load_device),
                                "compiled blocks") as cache, borrowed_on(patcher, patcher.load_device) as placeholders:
            ok = runner.compiled.compile_for(first_call, dm, patcher.load_device, dtype,
                                             patcher.model_options.get("transformer_options"),
                                             may_stream=_not_all_loaded(patcher) if patcher.is_dynamic() else None,
                                             check=not placeholders)
    except Exception as e:  # out of memory, a forward that fails on these inputs: the model still comes back
        # (ComfyUI's interrupt is a BaseException: a cancel still cancels)
        ok = runner.compiled.disable(f"compiling ahead failed: {type(e).__name__}: {str(e)[:200]}")
    if not ok:
        return f" (compiled blocks off: {runner.compiled.reason})"
    return (f" (blocks compiled for the calibration's shapes in {time.perf_counter() - t0:.1f} s"
            + (", from the compiled code an earlier process kept" if cache.loaded and cache.saved is None else "")
            + ("; another image size runs them uncompiled until they compile for it in the background, after its "
               "first image" if not runner.compiled.compile_new_shapes
               else "; another image size compiles at its first image") + ")")


def _not_all_loaded(patcher):
    """A callable: whether ComfyUI now holds less of ``patcher``'s weights on the GPU than the model
    has (what its own model management reads: ``model_size() - loaded_size()``), by more than its
    dynamic VRAM's page rounding."""
    return lambda: patcher.model_size() - patcher.loaded_size() >= STREAMED_BYTES


def placeholder_like(t: torch.Tensor, device) -> torch.Tensor:
    """A zero tensor on ``device`` of ``t``'s type, shape, dtype and strides - a tensor subclass
    (ComfyUI's ``QuantizedTensor``) rebuilt around zero inner tensors through the subclass
    protocol compiled code traces (``__tensor_flatten__``/``__tensor_unflatten__``).  What
    compiling needs of a weight: its metadata, not its values."""
    if hasattr(type(t), "__tensor_unflatten__"):
        names, ctx = t.__tensor_flatten__()
        inner = {n: placeholder_like(getattr(t, n), device) for n in names}
        return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
    return torch.zeros_like(t, device=device)


@contextmanager
def borrowed_on(patcher, device):
    """The diffusion model's weights on ``device`` for the block, as placeholders ComfyUI does not
    know of; yields whether they are placeholders (zeros: compiled code can be made on them, not
    checked).  The model is moved as ComfyUI's load moves it (each layer's own ``_apply``, which
    for ComfyUI's quantized layers makes new parameters in the current inference mode - compiled
    code guards on that), a weight not on ``device`` becoming a ``placeholder_like`` instead of a
    copy (a whole model not read from a page-cached file and copied); its own
    tensors are put back after (the same objects and storage; nothing is copied back) and the
    placeholders freed.

    Why not ComfyUI's own load: a model ComfyUI holds loaded stays loaded with the weights of that
    moment, and a LoRA connected after the node makes the sampler unload it - moving every weight
    back to the CPU (``unpatch_model``) - before loading it again with the LoRA, and the LoRA's
    first image cost far more than stock's (docs/benchmarks.md, section 0).  Borrowed, the model
    is loaded once, by the sampler, with whatever patches it then has.  Where the placeholders would
    not fit next to what ComfyUI keeps (or the model is ComfyUI's dynamic kind, streamed at run
    time), ComfyUI loads it as before (yields False: the real weights)."""
    model = patcher.model.diffusion_model
    mm = comfy.model_management
    if device.type != "cpu":
        # a dynamic model's weights are read at run time: not walked here (its state dict may be
        # backed by the file)
        dynamic = patcher.is_dynamic()
        need = 0 if dynamic else mm.minimum_inference_memory() + sum(
            t.nbytes for t in model.state_dict().values() if t.device != device)
        if not dynamic:
            mm.free_memory(need, device)
        if dynamic or mm.get_free_memory(device) < need:
            mm.load_models_gpu([patcher])
            yield False
            return
    as_fully_loaded(patcher)
    made = []

    def to_device(t):
        if t.device == device:
            return t
        made.append(1)
        return placeholder_like(t, device)
    try:
        with applied(model, to_device):
            yield bool(made)
    finally:
        cache = dequant_cache_of(patcher.model)
        if cache is not None:  # filled from the placeholders
            cache.release()


def as_fully_loaded(patcher) -> None:
    """The layers' state as ComfyUI's full load leaves it (and will set again): compiled code
    guards on it (an empty ``weight_function`` list in each layer's own dict)."""
    for m in patcher.model.diffusion_model.modules():
        if hasattr(m, "comfy_cast_weights"):
            m.comfy_force_cast_weights = patcher.force_cast_weights
            comfy.model_patcher.wipe_lowvram_weight(m)


@contextmanager
def applied(model, fn):
    """``fn`` applied to every parameter and buffer of ``model`` as ``module.to`` applies its
    conversion (``_apply``) for the block; the model's own tensors put back after - the same
    objects and storage, nothing copied back."""
    own = [(m, dict(m._parameters), dict(m._buffers), {k: p.data for k, p in m._parameters.items() if p is not None})
           for m in model.modules()]
    try:
        with torch.no_grad():
            model._apply(fn)
        yield
    finally:
        with torch.no_grad():
            for m, params, buffers, data in own:
                m._parameters.update(params)  # ComfyUI's quantized layers made new parameters
                m._buffers.update(buffers)
                for k, d in data.items():  # torch's own layers moved the parameters' data
                    if params[k].data_ptr() != d.data_ptr() or params[k].device != d.device:
                        params[k].data = d


def gpu_note(fmt_name: str) -> str:
    """What the current GPU does with the format (ComfyUI's own gates)."""
    fmt = FORMATS[fmt_name]
    dev = compute_device()
    if dev.type != "cuda":
        return f"{fmt_name}: no CUDA GPU here; ComfyUI computes it dequantized (smaller, not faster)"
    sm = torch.cuda.get_device_capability(dev)
    if fmt_name in native_formats(dev):
        return f"{fmt_name}: runs natively on this GPU (SM {sm[0]}.{sm[1]})"
    native = (f"{fmt_name}: needs SM {fmt.native_sm[0]}.{fmt.native_sm[1]}+ to run natively; "
              f"on this GPU (SM {sm[0]}.{sm[1]}) ")
    cores = w4a8.kind(dev) if fmt.lean_emulated == "w4a8" else None
    if cores:
        return native + (f"ComfyUI dequantizes it on every step (smaller, not faster); a lean runtime computes it "
                         f"on the {cores} tensor cores from the 4-bit weights (W4A8: inputs rounded to {cores} per "
                         "token) for the shapes where that times faster")
    return native + "ComfyUI dequantizes it on every step: smaller, not faster"


KEY = "comfy_modelopt_cuda_graphs"  # the APPLY_MODEL wrapper and patcher callbacks a runner installs
CONTROL_LORA_KEY = "comfy_modelopt_control_lora"


def enable_cuda_graphs(patcher, compile_blocks: bool = False):
    """A clone of ``patcher`` whose model evaluations are captured and replayed (over
    Inductor-compiled blocks with ``compile_blocks``, validated against eager), through ComfyUI's
    wrapper registry: other packs' wrappers - and a model function wrapper - keep working around
    it.  A MODEL that already replays through this runtime (Quantize Model's default) gets a fresh
    runner with these options in place of its own."""
    clone = patcher.clone()
    for kind in (WrappersMP.APPLY_MODEL, WrappersMP.CALC_COND_BATCH):
        clone.remove_wrappers_with_key(kind, KEY)
    for call_type in (CallbacksMP.ON_CLEANUP, CallbacksMP.ON_DETACH):
        clone.remove_callbacks_with_key(call_type, KEY)
    runner = CudaGraphs(clone, compile_blocks=compile_blocks)
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, runner)
    # the step's ControlNets replayed too (``control_graphs``), their graphs going with the model's
    controls = ControlGraphs()
    clone.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, KEY, controls)
    for graphs in (runner, controls):
        clone.add_callback_with_key(CallbacksMP.ON_CLEANUP, KEY, graphs.end_run)
        # a clone's detach without unpatching keeps the graphs: the weights' addresses and patches
        # are checked before every replay anyway
        clone.add_callback_with_key(CallbacksMP.ON_DETACH, KEY, release_on_detach(graphs.release))
    _release_on_partial_unload(clone, runner, controls)
    return clone, runner


def graph_runner(patcher):
    """The ``CudaGraphs`` runner of a MODEL (this pack's graph runtime), or None."""
    return next(iter(patcher.get_wrappers(WrappersMP.APPLY_MODEL, KEY)), None)


def _release_on_partial_unload(patcher, *runners) -> None:
    """ComfyUI frees VRAM for another model by unloading part of this one
    (``LoadedModel.model_unload`` -> ``partially_unload``), with no callback for it: the graphs
    (captured over the weights' addresses, useless once they move) go first, so their pool is
    what is freed.  A clone made later from this patcher has no such hook: its evaluations find
    the model partially loaded and release the graphs then."""
    unload = patcher.partially_unload

    def partially_unload(*args, **kwargs):
        for runner in runners:
            runner.release()
        return unload(*args, **kwargs)
    patcher.partially_unload = partially_unload
