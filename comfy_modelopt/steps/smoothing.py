"""SmoothQuant / AWQ scales per layer for own-loader files (``smooth_scale`` multiplies the
input at run time); stock files get smoothing folded into the producer (``folding``) instead."""
from __future__ import annotations

import torch

from ..smoothing import choose_smoothing
from . import Step, Work


class Smoothing(Step):
    name, order, fields = "smoothing", 10, ("smoothing", "smooth_alpha")

    def applies(self, work: Work) -> bool:
        return bool(work.layer.rank) and work.engine is None and work.recipe.smoothing != "none" \
            and work.x is not None

    def run(self, work: Work) -> None:
        found = choose_smoothing(work.w, work.layer_stats, work.fmt, work.recipe.smoothing, x=work.x, **work.opts)
        work.smooth = found.scales if found.scales is not None else torch.ones(work.layer.k, device=work.w.device)
        work.pre_scale = 1.0 / work.smooth
        work.notes.append(f"{work.recipe.smoothing} a={found.alpha:.1f} (smooth_scale)")


STEP = Smoothing()
