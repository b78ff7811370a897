"""Progress of long work as lines a person can follow: the phase, item i/N, time so far and an ETA.
Design: docs/design.md, ``progress.py``.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

PHASES = ("planning", "smoothing")  # the pipeline's passes before quantizing, by their items' first word


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``progress(done, total, item)`` as the pipeline and the samplers call it."""

    def __init__(self, phase: str, write: Callable[[str], None] | None = None, tty: bool | None = None,
                 unit: str = "layers", every: float = 30.0, clock=time.perf_counter):
        self.default_phase, self.unit, self.every, self.clock = phase, unit, every, clock
        self.write = write or (lambda line: sys.stderr.write(line + "\n"))
        self.tty = sys.stderr.isatty() if tty is None and write is None else bool(tty)
        self.phase, self.t0, self.tenth, self.said, self.last = None, 0.0, -1, 0.0, -1

    def _phase_of(self, item: str) -> tuple[str, str]:
        word, _, rest = item.partition(" ")
        return (word, rest) if word in PHASES else (self.default_phase, item)

    def __call__(self, done: int, total: int, item: str) -> None:
        if total <= 0:
            return
        phase, name = self._phase_of(item) if item else (self.phase or self.default_phase, "")
        now = self.clock()
        if phase != self.phase or done < self.last:  # a new pass: its own clock
            self.phase, self.t0, self.tenth, self.said = phase, now, -1, now
        self.last = done
        frac = min(done / total, 1.0)
        elapsed = now - self.t0
        eta = f"ETA {duration(elapsed / frac * (1 - frac))}" if 0 < frac < 1 and elapsed > 0 else ""
        if self.tty:
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{phase} [{bar:30s}] {done}/{total} {duration(elapsed):>6s} {eta:>10s} {name[:40]:40s}")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()
            return
        tenth = int(frac * 10)
        if tenth != self.tenth or now - self.said >= self.every:
            self.tenth, self.said = tenth, now
            where = f" ({name})" if name and done < total else ""
            self.write(f"{phase}: {done}/{total} {self.unit}, {duration(elapsed)}{', ' + eta if eta else ''}{where}")
