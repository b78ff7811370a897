"""fp8 per-tensor formats: E4M3 (W8A8 with a calibrated static input scale, else weight-only)
and E5M2 (weight-only)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import gptq
from ..scales import histogram_errors
from .base import E4M3_NAN, E5M2_NAN, Format, ModelOptQuantizers, nan_code_problem, tensor_scale


_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class Fp8Format(Format):
    @property
    def dtype(self) -> torch.dtype:
        return _FP8_DTYPES[self.name]

    def fmax(self) -> float:
        return torch.finfo(self.dtype).max

    def input_fmax(self):
        return float(self.fmax())

    def gptq_rounding(self, w, alpha, **opts):
        scale = float(self.weight_scale(w, alpha))
        return gptq.fp8_column_quantizer(scale, self.dtype), torch.tensor(scale)

    def layout_kwargs(self, **opts) -> dict:
        return {"dtype": _FP8_DTYPES[self.name]}

    def weight_scale(self, w: torch.Tensor, alpha: torch.Tensor | None,
                     amax: torch.Tensor | None = None) -> torch.Tensor:
        return tensor_scale(w, alpha, amax, self.fmax())

    def _prepare(self, w, alpha, opts):
        return w, {"scale": self.weight_scale(w, alpha)}

    def _explicit(self, scale):
        return {"scale": scale.reshape(()).float()}

    def _meta_extra(self, meta):
        return {"scale": torch.ones((), device="meta")}

    def _activation_kwargs(self, x, input_scale):
        # ComfyUI's fp8 layouts (comfy/quant_ops.py) take a missing input_scale as 1.0, where
        # kitchen's own would compute the activation's absmax
        scale = torch.ones((), device=x.device) if input_scale is None else input_scale
        return {"scale": scale, "dtype": self.dtype}

    def fake_act(self, x, input_scale=None, **opts):
        if input_scale is None:  # weight-only: the matmul runs in 16-bit
            return x
        fmax = self.fmax()
        q = (x * (1.0 / input_scale)).clamp(-fmax, fmax).to(_FP8_DTYPES[self.name])
        return q.to(torch.float32) * input_scale

    def value_problem(self, suffix, t):
        if suffix:
            return super().value_problem(suffix, t)
        return nan_code_problem(t, E4M3_NAN if self.dtype == torch.float8_e4m3fn else E5M2_NAN, "NaN/Inf")

    def fake_rows(self, w, alpha=None, amax=None):
        scale = self.weight_scale(w, alpha, amax)
        fmax = self.fmax()
        q = (w * (1.0 / scale)).clamp(-fmax, fmax).to(_FP8_DTYPES[self.name])
        return q.to(torch.float32) * scale


_FP8_KW = dict(layout="TensorCoreFP8Layout", native_sm=(8, 9), static_input_scale=True, needs_input_scale=True,
            free_scale="tensor", k_multiple=16, n_multiple=16, one_weight_scale=True, input_search=histogram_errors,
            native_gate="supports_fp8_compute", lean_kernel="fp8_scaled_mm")
# fp8 E4M3: per-tensor scale; W8A8 with a calibrated input_scale, else weight-only
FLOAT8_E4M3FN = Fp8Format(name="float8_e4m3fn", **_FP8_KW, candidate=2, colour=(52, 120, 246), modelopt=ModelOptQuantizers(
    {"num_bits": (4, 3), "axis": None}, {"num_bits": (4, 3), "axis": None}))
# fp8 E5M2: wider range, 2 mantissa bits; weight-only (an input_scale would make ComfyUI run an
# e5m2 x e5m2 GEMM, which torch refuses: "Multiplication of two Float8_e5m2 matrices
# is not supported")
FLOAT8_E5M2 = Fp8Format(name="float8_e5m2", **_FP8_KW, w8a8_gemm=False, colour=(90, 160, 250))
