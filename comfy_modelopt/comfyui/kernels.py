"""The lean runtime's direct kernels: kitchen's and torch's kernels - the ones stock ComfyUI ends in,
bit-exact with it - called without the per-call dispatch, one ``Kernel`` object per kind of layer.
Design: docs/design.md, ``comfyui/lean.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import comfy_kitchen as ck
import torch

from ..formats import CONVROT_GROUP_DEFAULT
from . import fourbit
from .records import ATTR

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
    compiler in ``fp8_traced``, three eager kernels here."""
    bound = torch.finfo(dtype).max
    return (x * inverse).clamp(-bound, bound).to(dtype)


_bias = fourbit.bias_of  # the layer's bias on the input's device in its dtype


def fp8_gemm(xq, qdata, scale_a, scale_b, bias, fast_accum: bool, out_dtype):
    """The eager GEMM of an fp8 layer on its 2-D input already in fp8 (compiled blocks trace
    ``fp8_traced`` instead: torch's operator, without the first call's check against kitchen)."""
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


def plain(t):
    """A parameter as the plain tensor Dynamo lifts as a graph input."""
    return t.detach() if isinstance(t, torch.nn.Parameter) else t


class Kernel:
    """A quantized layer's direct kernel (``LayerRecord.kernel``): ``forward(module, x)``, and
    ``traced(module)``: ``(op, weight, extra)`` compiled blocks trace as ``op(input, weight, bias,
    extra)`` in its place, or None (opaque)."""

    def traced(self, module):
        return None


@dataclass(frozen=True)
class Fp8Kernel(Kernel):
    fast_accum: bool = False

    def forward(self, module, x):
        return _fp8_forward(module, x, self.fast_accum)

    def traced(self, module):
        w = module.weight
        return fp8_traced, w._qdata, (plain(module.input_scale), w._params.scale, self.fast_accum)


def fp8_traced(input, weight, bias, extra):
    """The input rounded in traced code (fused), then torch's own GEMM operator, which Inductor calls
    without a Python custom operator's dispatch (docs/benchmarks.md, "What users attach")."""
    scale_a, scale_b, fast_accum = extra
    x2 = input.reshape(-1, input.shape[-1])
    xq = fp8_round(x2, (1.0 / scale_a).to(x2.dtype), weight.dtype)
    out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=input.dtype,
                           use_fast_accum=fast_accum)
    return out.reshape(*input.shape[:-1], out.shape[-1])


class Int8Kernel(Kernel):
    def forward(self, module, x):
        return _int8_forward(module, x)

    def traced(self, module):
        return (int8_traced, module.weight._qdata, int8_params(module.weight)) if dtype_code is not None else None


def int8_traced(input, weight, bias, extra):
    scale, convrot, group = extra
    return torch.ops.comfy_kitchen.int8_linear(input.contiguous(), weight, scale, bias, dtype_code(input.dtype),
                                               convrot, group)


class W4A8Kernel(Kernel):
    """4-bit weights on the 8-bit tensor cores (``fourbit``) where that times faster; opaque."""

    def forward(self, module, x):
        return fourbit.forward(module, x, _dequant_forward)

    @staticmethod
    def count(diffusion_model) -> int:
        return sum(isinstance(getattr(m.__dict__.get(ATTR), "kernel", None), W4A8Kernel)
                   for m in diffusion_model.modules())


@dataclass(frozen=True)
class DequantKernel(Kernel):
    """The weight dequantized (or from the ``DequantCache``), a 16-bit GEMM."""
    cache: object = None

    def forward(self, module, x):
        return _dequant_forward(module, x, self.cache)


# Format.lean_kernel -> its kernel's class; one its kitchen lacks is left out (stock path)
KERNELS = {"int8_linear": Int8Kernel, **({"fp8_scaled_mm": Fp8Kernel} if scaled_mm_v2 is not None else {})}
