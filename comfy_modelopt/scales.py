"""Choosing scales (never encoding them): weight clip factors by MSE search.

A clip factor ``alpha`` multiplies the absmax scale of a format's free scale (per tensor or
per output row).  ``alpha = 1`` is naive absmax, and it is always among the candidates, so the
chosen scale is never worse than absmax on the objective it was chosen for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Format

# Per-tensor searches look at a row subset of at most this many elements, then confirm on all.
SEARCH_ELEMENTS = 1 << 22


@dataclass
class ClipChoice:
    alpha: torch.Tensor | None   # None = absmax (alpha 1 everywhere)
    mean_alpha: float
    objective: str               # "weight" or "output"


def squared_error(fmt: Format, x: torch.Tensor, alpha, amax=None, xs: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Per-row squared error of fake-quantized x; on the outputs ``xs @ x.T`` when xs is given."""
    d = fmt.fake_rows(x, alpha, amax) - x
    if xs is None:
        return d.square().sum(dim=1)
    return (xs @ d.T).square().sum(dim=0)


def choose_weight_clip(w: torch.Tensor, fmt: Format, method: str = "mse",
                       xs: torch.Tensor | None = None, **opts) -> ClipChoice:
    """Clip factor minimising weight MSE (or output MSE on sampled inputs ``xs`` [m, K]).

    ``w`` is float32 [N, K]; ``xs`` holds input rows in the same basis as ``w``.
    """
    objective = "output" if xs is not None else "weight"
    if method == "absmax" or not fmt.free_scale:
        return ClipChoice(None, 1.0, objective)
    if method != "mse":
        raise ValueError(f"unknown weight scale method {method!r} (absmax or mse)")
    x = fmt.search_space(w, **opts)
    if xs is not None:
        xs = fmt.search_space(xs, **opts)
    grid = fmt.clip_candidates()
    if fmt.free_scale == "row":
        return _search_rows(fmt, x, xs, grid, objective)
    return _search_tensor(fmt, x, xs, grid, objective)


def _search_rows(fmt, x, xs, grid, objective) -> ClipChoice:
    best_err = torch.full((x.shape[0],), float("inf"))
    best = torch.ones(x.shape[0])
    for a in grid.tolist():
        err = squared_error(fmt, x, torch.tensor(a), xs=xs)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, a), best)
    if bool((best == 1.0).all()):
        return ClipChoice(None, 1.0, objective)
    return ClipChoice(best, float(best.mean()), objective)


def _search_tensor(fmt, x, xs, grid, objective) -> ClipChoice:
    amax = x.abs().amax()
    rows = x
    step = max(1, (x.numel() + SEARCH_ELEMENTS - 1) // SEARCH_ELEMENTS)
    if step > 1:
        rows = x[::step]
    errs = [float(squared_error(fmt, rows, torch.tensor(a), amax, xs).sum()) for a in grid.tolist()]
    a_best = float(grid[int(torch.tensor(errs).argmin())])
    if a_best == 1.0:
        return ClipChoice(None, 1.0, objective)
    if step > 1:  # confirm on every row that the subset's choice beats absmax
        full = float(squared_error(fmt, x, torch.tensor(a_best), amax, xs).sum())
        base = float(squared_error(fmt, x, None, amax, xs).sum())
        if full >= base:
            return ClipChoice(None, 1.0, objective)
    return ClipChoice(torch.tensor(a_best), a_best, objective)
