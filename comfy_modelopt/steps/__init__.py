"""The algorithms applied to one layer, each a room with a door: a module here defining ``STEP``.
Design: docs/design.md, ``steps/__init__.py``.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

import torch

from ..formats import Format
from ..heldout import Split
from ..plan import LayerPlan, Plan
from ..scales import ClipChoice


@dataclass
class Work:
    """One layer between its float weight and its encoding: what the steps read and change."""
    layer: LayerPlan
    plan: Plan
    layer_stats: object                 # stats.LayerStats, or None
    w: torch.Tensor                     # what is encoded: smoothed, minus the low-rank branch [N, K] float32
    x: torch.Tensor | None              # sampled inputs in the same (smoothed) basis [m, K]
    smooth: torch.Tensor | None = None  # [K] scales the stored weight is multiplied by (the input divided by)
    smoothed: torch.Tensor | None = None    # the whole smoothed weight (the branch included)
    clip: ClipChoice = field(default_factory=lambda: ClipChoice(None, 1.0, "weight"))
    input_scale: float | None = None    # static input_scale
    pre_scale: torch.Tensor | None = None   # own-loader smooth_scale (1/s) [K]
    branch: tuple | None = None         # (up [N, r], down [r, K]) bf16 low-rank branch
    split: Split | None = None          # sampled rows by prompt (smoothed basis): fit / held out
    engine: object = None               # ModelOpt's choices for this layer (modelopt_engine.EngineLayer)
    encoded: tuple | None = None        # (tensors by key suffix, QuantizedTensor) once a step has encoded
    notes: list = field(default_factory=list)

    @property
    def fmt(self) -> Format:
        return self.layer.fmt

    @property
    def opts(self) -> dict:
        return self.layer.opts

    @property
    def recipe(self):
        return self.plan.recipe

    def encode_plain(self) -> tuple:
        """Round-to-nearest encoding at the chosen clip (nvfp4: within its blocks' scale bounds)."""
        return self.fmt.encode(self.w, self.clip.alpha, **self.bound(), **self.opts)

    def bound(self) -> dict:
        """The chosen nvfp4 block scale bounds as the encoder's keyword (none: empty)."""
        return {} if self.clip.block_bound is None else {"block_bound": self.clip.block_bound}


class Step:
    """One algorithm: ``order`` places it among the others, ``fields`` are the recipe fields it reads."""
    name = ""
    order = 0
    fields: tuple = ()

    def applies(self, work: Work) -> bool:
        return True

    def run(self, work: Work) -> None:
        raise NotImplementedError


STEPS: list[Step] = []


def register(step: Step) -> Step:
    """Add ``step`` to the steps every layer runs (in its ``order``); returns it (``unregister``
    takes it out again)."""
    STEPS.append(step)
    STEPS.sort(key=lambda s: s.order)
    return step


def unregister(step: Step) -> None:
    STEPS.remove(step)


def run_steps(work: Work) -> Work:
    for step in list(STEPS):
        if step.applies(work):
            step.run(work)
    return work


for _mod in pkgutil.iter_modules(__path__):
    _found = importlib.import_module(f"{__name__}.{_mod.name}")
    for _step in getattr(_found, "STEPS", ()) or ((_found.STEP,) if hasattr(_found, "STEP") else ()):
        register(_step)
