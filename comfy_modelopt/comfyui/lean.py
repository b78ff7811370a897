"""Lean runtime: the same quantized layers and kernels as stock ComfyUI, without its per-call
Python dispatch.  Design: docs/design.md, ``comfyui/lean.py``.
"""
from __future__ import annotations

import json
import logging

import comfy_kitchen as ck
import torch

import comfy.model_detection
import comfy.model_management
import comfy.ops
import comfy.utils
from comfy.patcher_extension import CallbacksMP

from ..formats import CONVROT_GROUP_DEFAULT, FORMATS
from . import fourbit
from .records import ATTR, layer_record, model_record

try:
    from comfy.quant_ops import QuantizedTensor
except ImportError:  # pragma: no cover - ComfyUI without quant_ops cannot run quantized models
    QuantizedTensor = ()
try:  # the kernel behind ck.scaled_mm, called without its dispatch (bit-exact with stock)
    from comfy_kitchen.scaled_mm_v2 import scaled_mm_v2
except ImportError:  # pragma: no cover - other kitchen versions: fp8 layers stay on the stock path
    scaled_mm_v2 = None
try:  # private in kitchen 0.2.x: the output-dtype code of its int8_linear op
    from comfy_kitchen.tensor.int8 import _dtype_code as dtype_code
except ImportError:  # pragma: no cover - other kitchen versions: the public ck.int8_linear
    dtype_code = None


def fp8_round(x, inverse, dtype):
    """``x`` times ``inverse`` (1/scale in ``x``'s dtype) rounded to ``dtype``: kitchen's quantizer's
    formula (``quantize_per_tensor_fp8``, its eager backend) in torch operations - fused by the
    compiler in ``traced_layers``, three eager kernels here."""
    bound = torch.finfo(dtype).max
    return (x * inverse).clamp(-bound, bound).to(dtype)


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


_bias = fourbit.bias_of  # the layer's bias on the input's device in its dtype


def fp8_gemm(xq, qdata, scale_a, scale_b, bias, fast_accum: bool, out_dtype):
    """The GEMM of an fp8 layer on its 2-D input already in fp8 (also the compiled blocks'
    operator, ``traced_layers``, which rounds the input in traced code)."""
    if fast_accum:
        return torch._scaled_mm(xq, qdata.t(), scale_a=scale_a, scale_b=scale_b,
                                bias=bias, out_dtype=out_dtype, use_fast_accum=True)
    return _scaled_mm(xq.contiguous(), qdata.t(), scale_a, scale_b, bias, out_dtype)


# The eager path calls kitchen's kernels without its per-call dispatch (a Python custom op that
# asks kitchen's registry for a backend and checks its constraints every time - most of an SDXL
# layer's host time, and SDXL's eager forward is host-bound): the backend kitchen picks for a
# device and dtypes is asked once, and the GEMM is torch's own operator behind
# ``torch.nn.functional.scaled_mm`` (what kitchen's ``scaled_mm_v2`` calls), checked bit-equal
# with kitchen's call once per device and dtype.  The same kernels: bit-exact with stock.
_QUANTIZERS: dict = {}
_DIRECT_MM: dict = {}


def _quantize_fp8(x, scale, qdtype):
    key = (x.device.type, x.dtype, scale.dtype, qdtype)
    fn = _QUANTIZERS.get(key)
    if fn is None:
        try:
            from comfy_kitchen.registry import registry
            impl = registry.get_implementation("quantize_per_tensor_fp8",
                                               kwargs={"x": x, "scale": scale, "output_type": qdtype})
            fn = lambda x, scale, qdtype, impl=impl: impl(x, scale, qdtype)  # noqa: E731
        except Exception:  # pragma: no cover - another kitchen: its public entry point
            fn = ck.quantize_per_tensor_fp8
        _QUANTIZERS[key] = fn
    return fn(x, scale, qdtype)


def _scaled_mm(xq, wt, scale_a, scale_b, bias, out_dtype):
    key = (xq.device.type, out_dtype, bias is not None and bias.dtype)
    direct = _DIRECT_MM.get(key)
    if direct is None:  # the first call: checked against kitchen's
        ref = scaled_mm_v2(xq, wt, scale_a, scale_b, bias, out_dtype)
        try:
            out = _scaled_mm_v2(xq, wt, scale_a, scale_b, bias, out_dtype)
            direct = _DIRECT_MM[key] = out.dtype == ref.dtype and torch.equal(out, ref)
        except Exception:
            direct = _DIRECT_MM[key] = False
        return ref
    if direct:
        return _scaled_mm_v2(xq, wt, scale_a, scale_b, bias, out_dtype)
    return scaled_mm_v2(xq, wt, scale_a, scale_b, bias, out_dtype)


def _scaled_mm_v2(xq, wt, scale_a, scale_b, bias, out_dtype):
    """``torch.nn.functional.scaled_mm`` with per-tensor scales, as one call of its operator."""
    return torch._scaled_mm_v2(xq, wt, [scale_a], _TENSORWISE, _NO_SWIZZLE, [scale_b], _TENSORWISE, _NO_SWIZZLE,
                               bias, out_dtype, (), False)


try:
    _TENSORWISE = [torch.nn.functional.ScalingType.TensorWise.value]
    _NO_SWIZZLE = [torch.nn.functional.SwizzleType.NO_SWIZZLE.value]
except AttributeError:  # pragma: no cover - a torch without scaled_mm: kitchen's call decides
    _TENSORWISE = _NO_SWIZZLE = None


def _fp8_forward(module, x, fast_accum: bool):
    w, x2 = module.weight, x.reshape(-1, x.shape[-1])
    qdtype, scale = w._qdata.dtype, module.input_scale
    inverse = _inverse(module, scale, x2, qdtype) if x2.numel() <= _TORCH_ROUNDING_MAX else None
    xq = _quantize_fp8(x2, scale, qdtype) if inverse is None else fp8_round(x2, inverse, qdtype)
    out = fp8_gemm(xq, w._qdata, scale, w._params.scale, _bias(module, x), fast_accum, x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# An eager fp8 layer rounds an input of up to this many elements with three torch operations
# (kitchen's own formula, its eager backend's) instead of kitchen's CUDA kernel, whose Python entry
# (an allocation, the stream, three DLPack exports) costs more host time than a small layer's
# GEMM takes on the GPU - where eager SDXL is host-bound.  Taken per layer and input dtype only
# where the two agree bit for bit on every value of that dtype at the layer's scale (``_inverse``).
# Larger inputs keep the one-pass kernel (the operations read and write them three times); inside a
# CUDA-graph capture either rounds as fast (docs/benchmarks.md, "ControlNets replayed as graphs").
_TORCH_ROUNDING_MAX = 1 << 22
_EVERY: dict = {}  # (dtype, device) -> every finite and infinite value of a 16-bit dtype


def _inverse(module, scale, x, qdtype):
    """1/scale in ``x``'s dtype where torch's rounding of ``x`` equals kitchen's kernel's for every
    value of that dtype (checked once per layer, dtype and device, never inside a graph capture),
    else None."""
    rec = module.__dict__[ATTR]
    key = (x.dtype, x.device)
    inverse = rec.inverse.get(key) if rec.inverse else None
    if inverse is None:
        if x.dtype not in (torch.float16, torch.bfloat16) or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        every = _EVERY.get(key)
        if every is None:
            every = torch.arange(-32768, 32768, dtype=torch.int32, device=x.device).to(torch.int16).view(x.dtype)
            every = _EVERY[key] = every[~every.isnan()].reshape(1, -1)
        inverse = (1.0 / scale).to(x.dtype)
        mine = fp8_round(every, inverse, qdtype)
        if not torch.equal(mine.view(torch.uint8), _quantize_fp8(every, scale, qdtype).view(torch.uint8)):
            inverse = False
        rec.inverse = {**(rec.inverse or {}), key: inverse}
    return None if inverse is False else inverse


def int8_params(w) -> tuple:
    """(scale, convrot, group size) of an int8 weight, as kitchen's ``int8_linear`` takes them."""
    p = w._params
    return p.scale, bool(getattr(p, "convrot", False)), int(getattr(p, "convrot_groupsize", CONVROT_GROUP_DEFAULT))


def _int8_forward(module, x):
    w = module.weight
    scale, convrot, group = int8_params(w)
    x = x.contiguous()
    bias = _bias(module, x)
    key = (x.device.type, x.dtype, tuple(w._qdata.shape), convrot, group, bias is not None)
    fn = _INT8.get(key)
    if fn is None:  # kitchen's backend for this layer, asked once (see _QUANTIZERS)
        try:
            from comfy_kitchen.registry import registry
            kwargs = {"x": x, "weight": w._qdata, "weight_scale": scale, "bias": bias, "out_dtype": x.dtype,
                      "convrot": convrot, "convrot_groupsize": group}
            impl = registry.get_implementation("int8_linear", kwargs=kwargs)
            fn = lambda x, q, s, b, c, g, impl=impl: impl(x=x, weight=q, weight_scale=s, bias=b,  # noqa: E731
                                                          out_dtype=x.dtype, convrot=c, convrot_groupsize=g)
        except Exception:  # pragma: no cover - another kitchen: its public entry point
            fn = lambda x, q, s, b, c, g: ck.int8_linear(x, q, s, b, x.dtype, c, g)  # noqa: E731
        _INT8[key] = fn
    return fn(x, w._qdata, scale, bias, convrot, group)


_INT8: dict = {}


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
        if fmt is None or (rec is not None and rec.fast is not None):
            continue
        if not isinstance(module, LeanForward):
            foreign += 1
            continue
        full_precision = module._full_precision_mm or fmt not in native
        kernel = _kernel(fmt) if not full_precision else None
        kind = None  # what compiled blocks may trace as one operator (traced_layers)
        if kernel is _fp8_forward and getattr(module, "input_scale", None) is not None:
            fast = lambda m, x, fa=fast_accum: _fp8_forward(m, x, fa)  # noqa: E731
            kind = ("fp8", fast_accum)
        elif kernel is _int8_forward:
            fast, kind = _int8_forward, ("int8",)
        elif (full_precision and not getattr(module, "_full_precision_mm_config", False) and cache is None
              and getattr(FORMATS.get(fmt), "lean_emulated", "") == "w4a8" and fourbit.usable(module, device)):
            fast, kind = (lambda m, x: fourbit.forward(m, x, _dequant_forward)), ("w4a8",)  # timed against it
        elif full_precision:
            fast = lambda m, x, c=cache: _dequant_forward(m, x, c)  # noqa: E731
            dequantized += module.weight.numel()
        else:
            continue  # natively computed formats without a lean path (e.g. nvfp4 on Blackwell)
        rec = layer_record(module, create=True)
        # the kernel was picked for the load device: evaluated elsewhere (a CPU run on a GPU host),
        # ComfyUI's forward decides
        rec.fast, rec.fast_on, rec.lean_kernel = fast, device.type, kind
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
        if rec.fast is not None and input.device.type == rec.fast_on and _fast_path_ok(self, input):
            return rec.fast(self, input)
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


def _kernel(fmt_name: str):
    """The lean forward of a format's ``lean_kernel``, or None (stock path)."""
    fmt = FORMATS.get(fmt_name)
    return _KERNELS.get(fmt.lean_kernel) if fmt is not None else None


# Format.lean_kernel -> direct forward; a kernel its kitchen lacks is left out (stock path)
_KERNELS = {"int8_linear": _int8_forward}
if scaled_mm_v2 is not None:
    _KERNELS["fp8_scaled_mm"] = _fp8_forward
