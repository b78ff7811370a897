"""GPTQ: error-compensated rounding (Frantar et al., 2022), for formats whose scales are fixed
before rounding and that kitchen re-encodes exactly from the rounded values.

Columns are rounded one at a time; the rounding error of each is spread over the columns not
yet rounded, weighted by the inverse Hessian of the layer's output error (H = X^T X from the
calibration inputs).  Which formats can use it, and with which column rounder, is theirs to
say (``Format.gptq_rounding``): fp8 per-tensor and int8 per-row scales can; block-scaled
formats cannot (the encoder recomputes block scales from each block's maximum, which error
compensation moves), nor ConvRot (rounding happens in the rotated basis).
"""
from __future__ import annotations

from typing import Callable

import torch

def hessian(x: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """H = X^T X / m + damp * mean(diag) * I, in float64."""
    x = x.double()
    h = x.T @ x / max(x.shape[0], 1)
    d = torch.diagonal(h)
    h += torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * (damp * float(d.mean()) + 1e-12)
    return h


def gptq(w: torch.Tensor, h: torch.Tensor, quantize_columns: Callable[[torch.Tensor, slice], torch.Tensor],
         block: int = 128) -> torch.Tensor:
    """Rounded weight (on the quantization grid) of w [N, K] given H [K, K].

    ``quantize_columns(cols, index)`` rounds a [N, c] slice of columns (``index`` their position),
    with scales that are already fixed."""
    w = w.double().clone()
    n, k = w.shape
    dead = torch.diagonal(h) == 0
    h = h.clone()
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i:i + 1]
            qc = quantize_columns(col.float(), slice(i1 + i, i1 + i + 1)).double()
            q[:, i1 + i:i1 + i + 1] = qc
            e = (col - qc) / hinv1[i, i]
            w1[:, i:] -= e @ hinv1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q.float()


def fp8_column_quantizer(scale: float, dtype: torch.dtype):
    fmax = float(torch.finfo(dtype).max)

    def quant(cols, _index):
        return (cols * (1.0 / scale)).clamp(-fmax, fmax).to(dtype).float() * scale
    return quant


def int8_column_quantizer(row_scale: torch.Tensor):
    s = row_scale.reshape(-1, 1).float()

    def quant(cols, _index):
        return (cols / s).round().clamp(-128, 127) * s
    return quant
