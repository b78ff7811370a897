"""convrot_w4a4: Hadamard-rotated signed int4 weights and activations (int4 MMA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .int8 import RowwiseIntFormat, _anchored_rows


@dataclass(frozen=True)
class ConvRotW4A4Format(RowwiseIntFormat):
    def gptq_rounding(self, w, alpha, **opts):
        return _anchored_rows(self, w, alpha)

    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale"], "convrot_groupsize": int(conf.get("convrot_groupsize", 256)),
                "quant_group_size": 64, "linear_dtype": conf.get("linear_dtype", "int4")}

    def layout_kwargs(self, convrot_groupsize=256, linear_dtype="int4", **opts):
        return {"convrot_groupsize": convrot_groupsize, "linear_dtype": linear_dtype}

    def conf(self, weight_only=False, convrot_groupsize=256, linear_dtype="int4", **opts):
        conf = super().conf(weight_only)
        conf["convrot_groupsize"] = convrot_groupsize
        if linear_dtype != "int4":
            conf["linear_dtype"] = linear_dtype
        return conf

    def clip_candidates(self):
        return torch.linspace(0.4, 1.0, 13)

# Hadamard-rotated signed int4 weights and activations (int4 MMA)
CONVROT_W4A4 = ConvRotW4A4Format("convrot_w4a4", "TensorCoreConvRotW4A4Layout", (7, 5), False, False, "row", 64, 1,
                                 options=("convrot_groupsize", "linear_dtype"), lowrank=True, values_per_element=2,
                                 quantize_input=False, qmax=7, rotated=True)
