"""The basis every later step works in: the weight times the smoothing scales (folded into its
producer or stored as ``smooth_scale``), the sampled inputs divided by them, and those inputs
split by prompt into fit and held-out rows (``heldout``)."""
from __future__ import annotations

from ..heldout import split_rows
from . import Step, Work


class Basis(Step):
    name, order = "basis", 20

    def run(self, work: Work) -> None:
        if work.smooth is not None:
            work.smooth = work.smooth.to(work.w.device)
            work.w = work.w * work.smooth
            work.x = work.x / work.smooth if work.x is not None else None
        work.split = split_rows(work.x, work.layer_stats)
        work.smoothed = work.w


STEP = Basis()
