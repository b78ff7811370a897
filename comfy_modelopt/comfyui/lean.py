"""Lean runtime: the same quantized layers and kernels as stock ComfyUI, without its per-call
Python dispatch.  Design: docs/design.md, ``comfyui/lean.py``.
"""
from __future__ import annotations

import json
import logging

import torch

import comfy.model_detection
import comfy.model_management
import comfy.ops
import comfy.utils
from comfy.patcher_extension import CallbacksMP

from ..formats import FORMATS
from . import fourbit
from .kernels import KERNELS, DequantKernel, Fp8Kernel, Int8Kernel, W4A8Kernel
from .records import ATTR, layer_record, model_record

try:
    from comfy.quant_ops import QuantizedTensor
except ImportError:  # pragma: no cover - ComfyUI without quant_ops cannot run quantized models
    QuantizedTensor = ()


def native_formats(device) -> set:
    """Formats ComfyUI computes natively on ``device``: each format's ``native_on``, asking
    ComfyUI's own predicates."""
    return {name for name, f in FORMATS.items() if f.native_on(device, comfy.model_management)}


def unpatched(module, class_cast_ok: bool = False) -> bool:
    """No weight or bias functions (LoRA patches at run time) and no cast flags: the layer's own
    kernel may run (also what compiled blocks ask before tracing a layer, ``traced_layers``).

    ``class_cast_ok``: a cast flag that comes from the layer's class alone is no obstacle - a
    quantized file's 16-bit layers are ComfyUI's ``manual_cast`` ones (``MixedPrecisionOps``
    derives from it), whose cast path (``cast_bias_weight``) hands over the layer's own weight and
    bias when both are on the input's device in its dtype (``cast_to`` returns the tensor itself;
    the caller checks that at call time).  Not when ComfyUI's loader set the flag on the layer
    (lowvram or dynamic loading: the weight lives elsewhere, ``_v`` its dynamic slot)."""
    if (getattr(module, "weight_function", None) or getattr(module, "bias_function", None)
            or getattr(module, "comfy_force_cast_weights", False)):
        return False
    if not getattr(module, "comfy_cast_weights", False):
        return True
    return (class_cast_ok and "comfy_cast_weights" not in module.__dict__
            and not hasattr(module, "prev_comfy_cast_weights") and not hasattr(module, "_v"))


def _fast_path_ok(module, x) -> bool:
    return isinstance(w := module.weight, QuantizedTensor) and w.device == x.device and unpatched(module) and not x.requires_grad


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


def release_on_detach(release):
    """A ComfyUI ON_DETACH callback that calls ``release()`` when the weights leave.  ComfyUI also
    fires it, with ``unpatch_all`` False, when a clone sharing the callbacks is garbage-collected
    (every sampling run drops one) or replaced by another clone of the same model: the weights
    stay where they are, and so does what was built over them."""
    def on_detach(_patcher, unpatch_all=True) -> None:
        if unpatch_all:
            release()
    return on_detach


def _reserve_cache_memory(model, cache: DequantCache) -> None:
    """ComfyUI sizes the memory it frees before sampling with ``model.memory_required``."""
    base = model.memory_required

    def memory_required(*args, **kwargs):
        return base(*args, **kwargs) + cache.unallocated()
    model.memory_required = memory_required


def dequant_cache_of(model):
    """The ``DequantCache`` ``make_lean`` gave ComfyUI's ``model``, or None."""
    rec = model_record(model)
    return rec.dequant_cache if rec is not None else None


def make_lean(patcher, fast_accum: bool = False, dequant_cache_bytes: int = 0) -> int:
    """Give the quantized Linear layers of ``patcher``'s model (built with ``operations``) their
    direct kernels; returns how many.

    ``dequant_cache_bytes``: budget of a ``DequantCache`` for the layers computed dequantized
    (``model_record(patcher.model).dequant_cache`` afterwards; none for 0)."""
    device = patcher.load_device
    native = native_formats(device)
    count = dequantized = 0
    cache = dequant_cache_of(patcher.model)
    new_cache = dequant_cache_bytes > 0 and cache is None
    if new_cache:
        cache = DequantCache(patcher, dequant_cache_bytes)
        model_record(patcher.model, create=True).dequant_cache = cache
        _reserve_cache_memory(patcher.model, cache)
        patcher.add_callback_with_key(CallbacksMP.ON_DETACH, "comfy_modelopt_dequant_cache",
                                      release_on_detach(cache.release))
    foreign = 0
    for module in patcher.model.diffusion_model.modules():
        fmt = getattr(module, "quant_format", None)
        rec = layer_record(module)
        if fmt is None or (rec is not None and rec.kernel is not None):
            continue
        if not isinstance(module, LeanForward):
            foreign += 1
            continue
        full_precision, layout = module._full_precision_mm or fmt not in native, FORMATS.get(fmt)
        kernel = KERNELS.get(getattr(layout, "lean_kernel", "")) if not full_precision else None
        if kernel is Fp8Kernel and getattr(module, "input_scale", None) is not None:
            kernel = Fp8Kernel(fast_accum)
        elif kernel is Int8Kernel:
            kernel = Int8Kernel()
        elif (full_precision and not getattr(module, "_full_precision_mm_config", False) and cache is None
              and getattr(layout, "lean_emulated", "") == "w4a8" and fourbit.usable(module, device)):
            kernel = W4A8Kernel()  # timed against dequantizing, per shape
        elif full_precision:
            kernel = DequantKernel(cache)
            dequantized += module.weight.numel()
        else:
            continue  # natively computed formats without a lean path (e.g. nvfp4 on Blackwell)
        rec = layer_record(module, create=True)
        # the kernel was picked for the load device: evaluated elsewhere (a CPU run on a GPU host),
        # ComfyUI's forward decides
        rec.kernel, rec.kernel_on = kernel, device.type
        count += 1
    if foreign:
        logging.warning(f"[comfy-modelopt] lean runtime: {foreign} quantized layers were not built by this pack's "
                        "loader (ComfyUI's own loader, or operations this ComfyUI could not give): they run ComfyUI's "
                        "forward")
    if new_cache:
        # never reserve more than the layers computed dequantized can use (at the compute dtype)
        cache.budget = min(cache.budget, dequantized * patcher.model.get_dtype_inference().itemsize)
    return count


class LeanForward:
    """The forward of the Linear and Conv2d layers of the models this pack builds (``operations``:
    ComfyUI's own classes underneath): the own loader's computation where the layer is one of its
    kinds (``LayerRecord.own_forward``), around the direct kernel ``make_lean`` gave the layer -
    taken where the call allows it (``_fast_path_ok``: on the device it was picked for, the
    quantized weight there, no weight patches) - else ComfyUI's own forward."""

    def forward(self, input, *args, **kwargs):
        rec = self.__dict__.get(ATTR)  # records.LayerRecord
        if rec is None:
            return super().forward(input, *args, **kwargs)
        if rec.own_forward is not None:
            return rec.own_forward(self, input, lambda x: self._direct(rec, x, *args, **kwargs))
        return self._direct(rec, input, *args, **kwargs)

    def _direct(self, rec, input, *args, **kwargs):
        if rec.kernel is not None and input.device.type == rec.kernel_on and _fast_path_ok(self, input):
            return rec.kernel.forward(self, input)
        return super().forward(input, *args, **kwargs)


_OPERATIONS: dict = {}


def operations(sd: dict, metadata: dict | None, model_options: dict, own_layers: bool = False) -> tuple:
    """``(sd, metadata, ops)`` for ComfyUI's loader: the operations ComfyUI would pick for this
    state dict - its quantization layout read, the dtypes and the natively computed formats
    decided by ComfyUI's own calls, as its loader and model do - with ``LeanForward`` over their
    Linear and Conv2d, to pass as ``custom_operations`` (which makes ComfyUI's loader skip that
    preparation: it is done here, on a copy).  ``ops`` is None (and ``sd``, ``metadata`` the ones
    given) for a model ComfyUI does not detect, or one without quantized layers unless
    ``own_layers`` (the own loader's layer kinds need the class).  One class per dtypes and device:
    compiled code guards on a layer's class, so a model loaded again (a server switching models)
    runs the code compiled for the first."""
    mm = comfy.model_management
    work, meta = comfy.utils.convert_old_quants(dict(sd), "", metadata=metadata)
    stripped = comfy.utils.state_dict_prefix_replace(
        work, {comfy.model_detection.unet_prefix_from_state_dict(work): ""}, filter_keys=True)
    if stripped:
        work, meta = comfy.utils.convert_old_quants(stripped, "", metadata=meta)
    config = comfy.model_detection.model_config_from_unet(work, "", metadata=meta)
    if config is None or (config.quant_config is None and not own_layers):
        return sd, metadata, None
    device = model_options.get("load_device", mm.get_torch_device())
    supported = config.supported_inference_dtypes
    weight = None  # comfy.sd.load_diffusion_model_state_dict's choices, then BaseModel's pick
    if config.quant_config is None:
        weight = model_options.get("dtype") or mm.unet_dtype(
            model_params=comfy.utils.calculate_parameters(work), supported_dtypes=list(supported),
            weight_dtype=comfy.utils.weight_dtype(work))
    compute = mm.unet_manual_cast(weight, device, supported)
    fp8 = bool(model_options.get("fp8_optimizations", False))
    key = (weight, compute, str(mm.get_torch_device()), fp8, json.dumps(config.quant_config, sort_keys=True, default=str))
    ops = _OPERATIONS.get(key)
    if ops is None:
        base = comfy.ops.pick_operations(weight, compute, fp8_optimizations=fp8, model_config=config)
        ops = _OPERATIONS[key] = type("ModelOptOps", (base,), {
            name: type(name, (LeanForward, getattr(base, name)), {"__module__": __name__})
            for name in ("Linear", "Conv2d")})
    return work, meta, ops
