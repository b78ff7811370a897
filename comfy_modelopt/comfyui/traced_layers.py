"""Weight layers the compiler sees through: while compiled blocks are installed
(``compiled_blocks``), a weight layer whose forward is a plain kernel call - the lean fp8 and
int8 kernels, a 16-bit GEMM or 2-D convolution - reaches Dynamo as one opaque operator in the
block's graph instead of a graph break.  Design: docs/design.md, ``comfyui/traced_layers.py``.
"""
import types

import torch

from . import lean
from .kernels import plain
from .records import layer_record


def linear(input, weight, bias, _extra):
    return torch.nn.functional.linear(input, weight, bias)


def conv2d(input, weight, bias, geometry):
    return torch.nn.functional.conv2d(input, weight, bias, *geometry)


def _traced(self, input, *args, **kwargs):
    """The forward Dynamo traces: one operator for the layer (its record's ``traced``: op, weight,
    bias, the op's other arguments); any other call takes the layer's own forward."""
    rec = self._modelopt  # records.layer_record, read as the plain attribute Dynamo guards
    if args or kwargs or not torch.compiler.is_compiling():
        return rec.untraced(input, *args, **kwargs)
    op, weight, bias, extra = rec.traced
    sixteen_bit = op in (linear, conv2d)
    if input.device != weight.device or input.requires_grad or (sixteen_bit and input.dtype != weight.dtype):
        return rec.untraced(input)
    if bias is not None and bias.dtype != input.dtype:
        if sixteen_bit:  # the cast path would convert it: left to it
            return rec.untraced(input)
        bias = bias.to(input.dtype)
    return op(input, weight, bias, extra)


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
    bias = plain(b) if b is not None else None
    if lean.QuantizedTensor and isinstance(w, lean.QuantizedTensor):
        # no direct kernel, or a forward on top of the class's (a LoRA hook's): opaque
        kernel = rec.kernel if rec is not None and own is None else None
        op = kernel.traced(m) if kernel is not None else None
        if op is None:
            return None
        traced = (op[0], op[1], bias, op[2])
    elif own is None and type(m).__name__ == "Linear" and hasattr(m, "weight_function") and w.dim() == 2:
        # a 16-bit ComfyUI Linear on its class's forward: with the weight on the device in the
        # input's dtype, its cast path hands this very weight to F.linear
        traced = (linear, plain(w), bias, ())
    elif (own is None and type(m).__name__ == "Conv2d" and hasattr(m, "weight_function") and w.dim() == 4
          and getattr(m, "padding_mode", None) == "zeros"):
        # a 16-bit ComfyUI Conv2d on its class's forward (a UNet's ResBlocks, downsamplers):
        # uncast, or cast by its class with nothing to cast, it is torch's Conv2d._conv_forward
        # with the layer's own weight - F.conv2d with the module's geometry
        traced = (conv2d, plain(w), bias, (m.stride, m.padding, m.dilation, m.groups))
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
