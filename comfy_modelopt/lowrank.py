"""Low-rank branch for 4-bit formats (SVDQuant-style): W = L1 @ L2 + R, R quantized.

After smoothing has pushed the activation outliers into the weight (W * s), the largest singular
directions of the weight carry most of its energy; keeping a rank-r part in 16-bit and
quantizing only the residual R shrinks the residual's range and therefore its rounding error.

This module holds the math and the measurement; storage and runtime of the branch belong to the
own loader (stock ComfyUI cannot run it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Format


@dataclass
class LowRank:
    l1: torch.Tensor        # [N, r]  (U * S)
    l2: torch.Tensor        # [r, K]  (V^T)
    residual: torch.Tensor  # [N, K]  W - l1 @ l2


def lowrank_split(w: torch.Tensor, rank: int) -> LowRank:
    """Best rank-r approximation of w (Eckart-Young, via SVD) and what is left."""
    n, k = w.shape
    rank = max(0, min(rank, n, k))
    if rank == 0:
        return LowRank(w.new_zeros(n, 0), w.new_zeros(0, k), w.clone())
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    l1 = (u[:, :rank] * s[:rank]).to(w.dtype)
    l2 = vh[:rank].to(w.dtype)
    return LowRank(l1, l2, w - l1 @ l2)


def lowrank_error(w: torch.Tensor, fmt: Format, rank: int, x: torch.Tensor | None = None,
                  **opts) -> float:
    """Relative error of (l1 @ l2 + Q(R)) against w; on outputs x @ W^T when x [m, K] is given."""
    parts = lowrank_split(w, rank)
    approx = parts.l1 @ parts.l2 + fmt.fake_quant(parts.residual, **opts)
    diff, ref = approx - w, w
    if x is not None:
        diff, ref = x @ diff.T, x @ w.T
    denom = float(ref.norm())
    return float(diff.norm()) / denom if denom > 0 else 0.0


def error_by_rank(w: torch.Tensor, fmt: Format, ranks=(0, 8, 16, 32, 64, 128), x=None, **opts
                  ) -> dict[int, float]:
    return {r: lowrank_error(w, fmt, r, x, **opts) for r in ranks}
