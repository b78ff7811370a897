"""fp8 convolutions (``modelopt_conv_fp8``), a layer kind only comfy-modelopt's loader runs:
ComfyUI 0.29 quantizes only Linear layers.  Design: docs/design.md, ``formats/conv_fp8.py``.
"""
from __future__ import annotations

import math

import torch

from ..fileformat import CONV_FORMAT
from ..safetensors_io import is_int
from .base import E4M3_NAN, F8_E4M3_MAX, shown, check_common_fields, nan_code_problem, positive_problem

# A channel's absmax is stored at 224, not 448: ComfyUI applies a LoRA to a plain fp8 weight by
# adding the (mapped) delta and rounding back to fp8, which saturates at 448, so the headroom
# lets a delta as large as the channel's own largest weight through unclipped.  e4m3's relative
# precision is the same one binade lower (measured: identical weight error on UNet-like weights).
CONV_STORED_MAX = F8_E4M3_MAX / 2


class ConvFp8:
    name = CONV_FORMAT

    @staticmethod
    def encode(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A Conv2d weight [O, ...] as float8_e4m3fn [O, I*kh*kw] and its float32 scales [O]: each
        output channel's absmax / 224, or (``per_tensor``) the weight's absmax / 224 for every
        channel - the same stored layout.  Per-layer errors do not tell them apart where the model's
        output does (docs/benchmarks.md#conv-unet): quantize_module chooses by the model's output
        (model_checks.conv_per_tensor)."""
        w2 = w.reshape(w.shape[0], -1).float()
        peak = w2.abs().amax() if per_tensor else w2.abs().amax(dim=1)
        scale = (peak / CONV_STORED_MAX).clamp_min(torch.finfo(torch.float32).tiny).expand(w2.shape[0]).contiguous()
        return (w2 / scale[:, None]).clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn), scale

    @staticmethod
    def decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The float32 weight of stored (or 4-D) fp8 values ``q`` and their per-output-channel ``scale``."""
        return q.float() * scale.to(q.device, torch.float32).view(-1, *[1] * (q.dim() - 1))

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
