"""What the runtime changed on a ComfyUI module or model, in one record each.
Design: docs/design.md, ``comfyui/records.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ATTR = "_modelopt"


@dataclass(eq=False)
class LayerRecord:
    kernel: object = None             # its direct kernel (``kernels.Kernel``, given by ``lean.make_lean``)
    kernel_on: str | None = None      # ... for inputs on this device type
    own_forward: object = None        # own loader: (module, x, inner) -> y, its layer's computation around the
    #                                   class's (``inner``: the direct kernel or ComfyUI's; an fp8 convolution replaces it)
    inverse: dict | None = None       # lean fp8: (input dtype, device) -> 1/input scale for torch's rounding, or False
    traced: tuple | None = None       # while compiled blocks are installed: (op, weight, bias, extra)
    untraced: object = None           # ... and the forward any other call takes


@dataclass(eq=False)
class ModelRecord:
    dequant_cache: object = None      # lean.DequantCache of the layers computed dequantized
    stored_basis: dict = field(default_factory=dict)  # own loader: weight key -> what a delta is divided by


def layer_record(module, create: bool = False) -> LayerRecord | None:
    """``module``'s record (made with ``create``), or None."""
    return _record(module, LayerRecord, create)


def model_record(model, create: bool = False) -> ModelRecord | None:
    """The record of ComfyUI's ``BaseModel`` (``patcher.model``) (made with ``create``), or None."""
    return _record(model, ModelRecord, create)


def _record(obj, kind, create: bool):
    rec = obj.__dict__.get(ATTR)
    if rec is None and create:
        rec = kind()
        setattr(obj, ATTR, rec)
    return rec
