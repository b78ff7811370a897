"""ModelOpt's calibration choices (``modelopt_engine``) in place of the own searches: its AWQ /
SVDQuant smoothing on own-loader layers, its input range, absmax weights (its max calibrator)
and AWQ's clip ratio."""
from __future__ import annotations

import torch

from ..scales import ClipChoice
from . import Step, Work
from .input_scale import input_scale


class EngineSmoothing(Step):
    name, order = "modelopt smoothing", 10

    def applies(self, work: Work) -> bool:
        return bool(work.layer.rank) and work.engine is not None and work.engine.smooth is not None

    def run(self, work: Work) -> None:
        work.smooth = work.engine.smooth.to(work.w.device)
        work.pre_scale = 1.0 / work.smooth
        work.notes.append(f"ModelOpt {work.plan.engine.algorithm} smoothing (smooth_scale)")


class EngineChoices(Step):
    name, order = "modelopt", 40

    def applies(self, work: Work) -> bool:
        return work.engine is not None

    def run(self, work: Work) -> None:
        engine, fmt = work.engine, work.fmt
        if work.layer.static_input:
            work.input_scale = (engine.input_amax / fmt.input_fmax() if work.smooth is None and engine.input_amax
                                else input_scale(work.layer_stats, fmt, "max", work.recipe.percentile, work.smooth))
        if work.plan.engine.algorithm == "awq_full" and not work.layer.rank:
            ratio = engine.weight_clip
            if ratio is not None and (work.smooth is not None or engine.smooth is None):
                work.clip = ClipChoice(torch.tensor(ratio), ratio, "weight")
                work.notes.append(f"ModelOpt awq_clip ratio {ratio:.2f}")
            elif ratio is not None:
                work.notes.append(f"ModelOpt awq_clip ratio {ratio:.2f} dropped with its smoothing")


STEPS = (EngineSmoothing(), EngineChoices())
