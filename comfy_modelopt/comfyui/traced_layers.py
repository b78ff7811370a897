"""Weight layers the compiler sees through: while compiled blocks are installed
(``compiled_blocks``), a weight layer whose forward is a plain kernel call - the lean fp8 and
int8 kernels, a 16-bit GEMM or 2-D convolution - reaches Dynamo as one opaque operator in the
block's graph instead of a graph break.  Design: docs/design.md, ``comfyui/traced_layers.py``.
"""
import types

import torch

from . import lean
from .lean import fp8_round
from .records import layer_record


def _plain(t):
    """A parameter as the plain tensor Dynamo lifts as a graph input."""
    return t.detach() if isinstance(t, torch.nn.Parameter) else t


def _fp8_input(x, scale, dtype):
    """``x`` [N, K] rounded to ``dtype`` with the static ``scale``."""
    return fp8_round(x, (1.0 / scale).to(x.dtype), dtype)


def fp8_gemm(xq, qdata, scale_a, scale_b, bias, fast_accum: bool, out_dtype):
    """An fp8 layer's GEMM on its 2-D input in fp8, as the compiler sees it: torch's own operator
    (the cuBLASLt call behind the eager path's ``scaled_mm``), which Inductor calls without Python
    in between: a Python custom operator's dispatch per layer call showed in the eager path's profile
    where a region runs without a graph (docs/benchmarks.md, "What users attach")."""
    return torch._scaled_mm(xq, qdata.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _traced(self, input, *args, **kwargs):
    """The forward Dynamo traces: one operator for the layer (its record's ``traced``: kind, weight,
    bias, the kind's other arguments); any other call takes the layer's own forward."""
    rec = self._modelopt  # records.layer_record, read as the plain attribute Dynamo guards
    if args or kwargs or not torch.compiler.is_compiling():
        return rec.untraced(input, *args, **kwargs)
    kind, weight, bias, extra = rec.traced
    sixteen_bit = kind in ("linear", "conv2d")
    if input.device != weight.device or input.requires_grad or (sixteen_bit and input.dtype != weight.dtype):
        return rec.untraced(input)
    if bias is not None and bias.dtype != input.dtype:
        if sixteen_bit:  # the cast path would convert it: left to it
            return rec.untraced(input)
        bias = bias.to(input.dtype)
    if kind == "fp8":
        scale_a, scale_b, fast_accum = extra
        x2 = input.reshape(-1, input.shape[-1])
        out = fp8_gemm(_fp8_input(x2, scale_a, weight.dtype), weight, scale_a, scale_b, bias, fast_accum, input.dtype)
        return out.reshape(*input.shape[:-1], out.shape[-1])
    if kind == "int8":
        scale, convrot, group = extra
        return torch.ops.comfy_kitchen.int8_linear(input.contiguous(), weight, scale, bias,
                                                   lean.dtype_code(input.dtype), convrot, group)
    if kind == "conv2d":
        return torch.nn.functional.conv2d(input, weight, bias, *extra)
    return torch.nn.functional.linear(input, weight, bias)


def traced_forward(m, untraced):
    """A forward for layer ``m`` that Dynamo traces as one operator, with what it reads in the
    layer's record (``records.LayerRecord.traced``) - or None where the layer must stay opaque.  ``untraced``: the
    opaque forward every other call takes (and a traced call whose input is on another device)."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    rec = layer_record(m)
    # nothing a call could still route elsewhere (lean's fast-path check less what only the
    # input decides - the traced forward checks that), and none of the own loader's layer kinds
    if (not isinstance(w, torch.Tensor) or (b is not None and b.device != w.device)
            or not lean.unpatched(m, class_cast_ok=type(m).__name__ == "Conv2d")
            or (rec is not None and rec.own_forward is not None)):
        return None
    own = m.__dict__.get("forward")
    bias = _plain(b) if b is not None else None
    if lean.QuantizedTensor and isinstance(w, lean.QuantizedTensor):
        kind = rec.lean_kernel if rec is not None else None
        if kind is None or own is not None:
            return None  # no direct kernel, or a forward on top of the class's (a LoRA hook's)
        if kind[0] == "fp8":
            traced = ("fp8", w._qdata, bias, (_plain(m.input_scale), w._params.scale, kind[1]))
        elif kind[0] == "int8" and lean.dtype_code is not None:
            traced = ("int8", w._qdata, bias, lean.int8_params(w))
        else:
            return None
    elif own is None and type(m).__name__ == "Linear" and hasattr(m, "weight_function") and w.dim() == 2:
        # a 16-bit ComfyUI Linear on its class's forward: with the weight on the device in the
        # input's dtype, its cast path hands this very weight to F.linear
        traced = ("linear", _plain(w), bias, ())
    elif (own is None and type(m).__name__ == "Conv2d" and hasattr(m, "weight_function") and w.dim() == 4
          and getattr(m, "padding_mode", None) == "zeros"):
        # a 16-bit ComfyUI Conv2d on its class's forward (a UNet's ResBlocks, downsamplers):
        # uncast, or cast by its class with nothing to cast, it is torch's Conv2d._conv_forward
        # with the layer's own weight - F.conv2d with the module's geometry
        traced = ("conv2d", _plain(w), bias, (m.stride, m.padding, m.dilation, m.groups))
    else:
        return None
    rec = layer_record(m, create=True)
    rec.traced, rec.untraced = traced, untraced
    return types.MethodType(_traced, m)


def clear(m) -> None:
    """Forget what ``traced_forward`` set on ``m`` (the weights may move or change before the next
    installation)."""
    rec = layer_record(m)
    if rec is not None:
        rec.traced = rec.untraced = None
