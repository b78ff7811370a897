"""The errors comfy-modelopt raises on purpose.  Design: docs/design.md, ``errors.py``."""
from __future__ import annotations

from dataclasses import dataclass


class ModelOptError(Exception):
    """Base of every deliberate comfy-modelopt error."""


class CheckpointError(ModelOptError, ValueError):
    """A file that is not a readable checkpoint (or statistics file); names the file and key."""


class PlanError(ModelOptError, ValueError):
    """A model (or a request) that cannot be planned: nothing to quantize, already quantized..."""


class QuantizeError(ModelOptError, RuntimeError):
    """A layer that cannot be quantized; the message names it."""


class CalibrationError(ModelOptError, ValueError):
    """Statistics that cannot be used; the message says which layer or file and why."""


class OutputError(ModelOptError, OSError):
    """An output path that cannot be written (exists, is the input, folder missing...)."""


class OutputExistsError(OutputError, FileExistsError):
    """The output exists and ``overwrite`` was not given (or another run created it first)."""


def one_line(text: str) -> str:
    """``text`` on one line (newlines and runs of spaces folded), for error messages."""
    return " ".join(str(text).split())


@dataclass(frozen=True)
class Problem:
    """One broken rule of a file, found by ``verify`` (not raised: a verification lists them all)."""
    key: str
    rule: str

    def __str__(self) -> str:
        return f"{self.key}: {self.rule}"
