"""Held-out checks for every search: choose on some calibration prompts, score on others.
Design: docs/design.md, ``heldout.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Split:
    fit: torch.Tensor    # [m1, K] rows the searches choose on
    held: torch.Tensor   # [m2, K] rows of other prompts they are checked on

    @property
    def growth(self) -> float:
        """How far the held-out prompts' inputs went past the fit prompts' max (>= 1)."""
        fit = float(self.fit.abs().max())
        return max(1.0, float(self.held.abs().max()) / fit) if fit > 0 else 1.0

    def channel_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel absmax and mean |x| of the fit rows (what smoothing searches use)."""
        a = self.fit.abs()
        return a.amax(dim=0), a.mean(dim=0)


def split_rows(x: torch.Tensor | None, layer_stats) -> Split | None:
    """The fit/held-out split of sampled rows ``x`` (``layer_stats.sample()`` in some basis), or
    None without two known calibration groups (one prompt, or statistics saved before groups)."""
    if x is None or layer_stats is None:
        return None
    masks = layer_stats.held_out_split()
    if masks is None:
        return None
    fit, held = masks
    return Split(x[fit.to(x.device)], x[held.to(x.device)])


def rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    """||diff|| / ||ref|| (0 for a zero reference): the relative error every measure reports."""
    denom = float(ref.norm())
    return float(diff.norm()) / denom if denom > 0 else 0.0
