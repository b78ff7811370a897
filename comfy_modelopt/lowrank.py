"""Low-rank branch for 4-bit formats (SVDQuant-style): W = L1 @ L2 + R, R quantized.
Design: docs/design.md, ``lowrank.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LowRank:
    l1: torch.Tensor        # [N, r]  (U * S)
    l2: torch.Tensor        # [r, K]  (V^T)
    residual: torch.Tensor  # [N, K]  W - l1 @ l2


def lowrank_split(w: torch.Tensor, rank: int) -> LowRank:
    """Best rank-r approximation of w (Eckart-Young) and what is left.

    Small matrices take a full SVD.  Large ones take the top right-singular subspace by seeded
    randomized subspace iteration (Halko et al.): a full float64 SVD of every large weight would take
    hours for a Flux-size model, and this one's residual is close to the exact optimum on
    trained-like spectra (the tests check 1e-3)."""
    n, k = w.shape
    rank = max(0, min(rank, n, k))
    if rank == 0:
        return LowRank(w.new_zeros(n, 0), w.new_zeros(0, k), w.clone())
    if min(n, k) <= 4 * (rank + OVERSAMPLE):
        u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
        l1 = (u[:, :rank] * s[:rank]).to(w.dtype)
        l2 = vh[:rank].to(w.dtype)
    else:
        wf = w.float()
        v = top_right_singular(wf, rank)          # [r, K], orthonormal rows
        l1, l2 = (wf @ v.T).to(w.dtype), v.to(w.dtype)  # W V^T V: the best fit on that subspace
    return LowRank(l1, l2, w - l1 @ l2)


OVERSAMPLE, POWER_ITERS = 16, 6


def top_right_singular(w: torch.Tensor, rank: int, seed: int = 0) -> torch.Tensor:
    """The top-``rank`` right-singular vectors of ``w`` [N, K] as rows [rank, K] (randomized
    subspace iteration with re-orthonormalization; deterministic for a given seed)."""
    n, k = w.shape
    width = min(rank + OVERSAMPLE, n, k)
    g = torch.Generator(device=w.device).manual_seed(seed)
    z = torch.randn(k, width, generator=g, dtype=w.dtype, device=w.device)
    y = w @ z
    for _ in range(POWER_ITERS):
        y, _ = torch.linalg.qr(y)
        z, _ = torch.linalg.qr(w.T @ y)
        y = w @ z
    _, _, vh = torch.linalg.svd(y, full_matrices=False)  # order the subspace by singular value
    return (z @ vh.T)[:, :rank].T


def branch_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a loaded low-rank branch is held in: the model's 16-bit dtype, else float32."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def branched_weight(inner_weight: torch.Tensor, down=None, up=None, smooth=None) -> torch.Tensor:
    """The float32 weight ``branched`` computes with, from its inner layer's (float) weight: the
    branch ``up @ down`` added, both times the input smoothing."""
    w = inner_weight.float()
    if up is not None and down is not None:
        w = w + (up.float() @ down.float()).to(w.device)
    return w * smooth.float().to(w.device) if smooth is not None else w


def branched(x, inner, down, up, smooth=None, to=lambda t, x: t.to(x.device, x.dtype)):
    """A low-rank layer's output: the (``smooth``-scaled) input through ``inner`` (the quantized
    residual's layer) plus the branch ``up @ down`` (``to``: moves a tensor to the input's device
    and dtype - ComfyUI's cast in its runtime)."""
    if smooth is not None:
        x = x * to(smooth, x)
    return inner(x) + torch.nn.functional.linear(torch.nn.functional.linear(x, to(down, x)), to(up, x))
