"""mxfp8: E4M3 values with one E8M0 scale per 32; dynamic activations."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import gptq
from .base import E4M3_NAN, E8M0_NAN, F8_E4M3_MAX, Format, nan_code_problem


def _mxfp8_block_scales(block_amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 scale of each 32-value block as kitchen derives it: 2^ceil(log2(amax / 448))."""
    return torch.exp2(torch.ceil(torch.log2((block_amax / F8_E4M3_MAX).clamp(min=2.0 ** -127))).clamp(-127, 127))


@dataclass(frozen=True)
class MxFp8Format(Format):
    def native_on(self, device, gates=None) -> bool:
        # ComfyUI registers mxfp8 only where torch has the float8_e8m0fnu kernels it needs (2.10+)
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 10):
            return False
        return super().native_on(device, gates)

    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale"].view(torch.float8_e8m0fnu)}

    def value_problem(self, suffix, t):
        if suffix == "_scale":  # E8M0 block scales: 0xFF is NaN, every other byte a power of two
            return nan_code_problem(t, E8M0_NAN, "NaN (E8M0 0xFF) block-scale")
        return nan_code_problem(t, E4M3_NAN, "NaN")

    def fake_act(self, x, input_scale=None, **opts):
        return self.fake_rows(x)

    def gptq_rounding(self, w, alpha, **opts):
        # block scales fixed as kitchen derives them from the unrounded weight (2^ceil(log2(amax /
        # 448))); each block's largest element anchored on the grid above 224 (gptq.py)
        if w.shape[1] % 32:
            return None
        n, k = w.shape
        amax = w.abs().reshape(n, k // 32, 32).amax(dim=-1).float()
        scale = torch.where(amax == 0, torch.zeros_like(amax), _mxfp8_block_scales(amax))
        return gptq.grid_column_quantizer(scale, 32, gptq.anchors(w, 32), F8_E4M3_MAX, gptq.round_e4m3,
                                          gptq.e4m3_up), None

    def fake_rows(self, w, alpha=None, amax=None):
        n, k = w.shape
        pad_n, pad_k = -n % 32, -k % 32
        x = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w
        blocks = x.reshape(x.shape[0], -1, 32)
        amax = blocks.abs().amax(dim=-1).float()
        scale = torch.where(amax == 0, torch.ones_like(amax), _mxfp8_block_scales(amax)).unsqueeze(-1)
        q = (blocks / scale).clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn).float()
        deq = torch.where(amax.unsqueeze(-1) == 0, torch.zeros_like(q), q * scale)
        return deq.reshape(x.shape)[:n, :k]


# MXFP8: E4M3 values with one E8M0 scale per 32; dynamic activations
MXFP8 = MxFp8Format(name="mxfp8", layout="TensorCoreMXFP8Layout", native_sm=(10, 0), static_input_scale=False,
                    needs_input_scale=False, free_scale="", k_multiple=32, colour=(145, 80, 220),
                    native_gate="supports_mxfp8_compute", block=32)
