"""The reservoir's sampler: which calibration rows the per-layer sample keeps."""
from __future__ import annotations

import math
import random


class ReservoirChain:
    """Which rows replace a slot of a full reservoir: Algorithm L (Li, 1994), exact uniform
    reservoir sampling that draws three random numbers per *replacement* instead of one per row.
    The chain is a function of the seed alone, so the sample does not depend on how the rows
    were split into calls; after loading saved statistics it is replayed up to the rows already
    seen (cheap: about capacity * ln(rows / capacity) steps)."""

    def __init__(self, capacity: int, seed: int):
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.w = math.exp(math.log(self._u()) / capacity)
        self.next = capacity - 1 + self._skip()  # the next row that takes a slot
        self.slot = self.rng.randrange(capacity)

    def _u(self) -> float:
        return 1.0 - self.rng.random()  # (0, 1]

    def _skip(self) -> int:
        log_keep = math.log1p(-self.w) if self.w < 1.0 else -math.inf
        if log_keep == 0.0:  # w underflowed: no further row is ever taken
            return 1 << 62
        return min(int(math.floor(math.log(self._u()) / log_keep)) + 1, 1 << 62)

    def take(self, start: int, end: int) -> dict:
        """{slot: row} for the rows in [start, end) that take a slot (the last one per slot:
        later rows overwrite earlier ones, as in the sequential algorithm).  Rows below
        ``start`` are skipped over (a chain resumed after loading saved statistics)."""
        chosen = {}
        while self.next < end:
            if self.next >= start:
                chosen[self.slot] = self.next
            self.w *= math.exp(math.log(self._u()) / self.capacity)
            self.next += self._skip()
            self.slot = self.rng.randrange(self.capacity)
        return chosen
