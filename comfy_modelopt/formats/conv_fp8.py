"""fp8 convolutions (``modelopt_conv_fp8``), a layer kind only comfy-modelopt's loader runs:
ComfyUI 0.29 quantizes only Linear layers.  Design: docs/design.md, ``formats/conv_fp8.py``.
"""
from __future__ import annotations

import math

import torch

from ..fileformat import CONV_FORMAT
from ..safetensors_io import is_int
from .base import E4M3_NAN, shown, check_common_fields, nan_code_problem, positive_problem


class ConvFp8:
    name = CONV_FORMAT

    @staticmethod
    def conf(shape) -> dict:
        return {"format": CONV_FORMAT, "shape": [int(d) for d in shape]}

    @staticmethod
    def planned(shape) -> dict[str, tuple[str, tuple]]:
        """Stored tensors by key suffix: (safetensors dtype, shape) for a 4-D ``shape``."""
        o = int(shape[0])
        return {".weight": ("F8_E4M3", (o, math.prod(shape[1:]))), ".weight_scale": ("F32", (o,))}

    @staticmethod
    def stored_options(conf: dict) -> tuple:
        """The 4-D weight shape a stored layer's config names (ValueError naming the field)."""
        check_common_fields(conf, CONV_FORMAT)
        shape = conf.get("shape")
        if not (isinstance(shape, list) and len(shape) == 4 and all(is_int(d) and d > 0 for d in shape)):
            raise ValueError(f"'shape' must be the 4 positive sizes of the convolution's weight, got {shown(shape)}")
        return tuple(shape)

    @staticmethod
    def value_problem(suffix: str, t: torch.Tensor) -> str | None:
        return nan_code_problem(t, E4M3_NAN, "NaN") if suffix == ".weight" else positive_problem(t)


CONV_FP8 = ConvFp8()
