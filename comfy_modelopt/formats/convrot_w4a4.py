"""convrot_w4a4: Hadamard-rotated signed int4 weights and activations (int4 MMA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import CONVROT_GROUP_DEFAULT
from .base import shown, option
from .int8 import RowwiseIntFormat, anchored_rows, rotation_group


@dataclass(frozen=True)
class ConvRotW4A4Format(RowwiseIntFormat):
    def gptq_rounding(self, w, alpha, **opts):
        return anchored_rows(self, w, alpha)

    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale"], "quant_group_size": 64, **self.stored_options(conf)}

    def stored_options(self, conf):
        super().stored_options(conf)
        linear_dtype = option(conf, "linear_dtype", "int4")
        if linear_dtype not in ("int4", "int8"):
            raise ValueError(f"'linear_dtype' must be 'int4' or 'int8', got {shown(linear_dtype)}")
        return {"convrot_groupsize": rotation_group(conf), "linear_dtype": linear_dtype}

    def layout_kwargs(self, convrot_groupsize=CONVROT_GROUP_DEFAULT, linear_dtype="int4", **opts):
        return {"convrot_groupsize": convrot_groupsize, "linear_dtype": linear_dtype}

    def conf(self, weight_only=False, convrot_groupsize=CONVROT_GROUP_DEFAULT, linear_dtype="int4", **opts):
        conf = super().conf(weight_only)
        conf["convrot_groupsize"] = convrot_groupsize
        if linear_dtype != "int4":
            conf["linear_dtype"] = linear_dtype
        return conf

    def clip_candidates(self):
        return torch.linspace(0.4, 1.0, 13)

# Hadamard-rotated signed int4 weights and activations (int4 MMA)
CONVROT_W4A4 = ConvRotW4A4Format(name="convrot_w4a4", layout="TensorCoreConvRotW4A4Layout", native_sm=(7, 5),
                                 static_input_scale=False, needs_input_scale=False, free_scale="row", k_multiple=64,
                                 options=("convrot_groupsize", "linear_dtype"), lowrank=True, values_per_element=2,
                                 quantize_input=False, qmax=7, rotated=True, colour=(214, 60, 60))
