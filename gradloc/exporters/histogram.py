"""A histogram the telemetry state keeps (exporters/state.py): per-bucket counts, sum, count, one exemplar per
bucket."""
from __future__ import annotations

import math

import numpy as np

from gradloc.exporters.snapshot import Exemplar


class Hist:
    __slots__ = ("bounds", "counts", "sum", "count", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = [0] * (len(bounds) + 1)
        self.sum, self.count = 0.0, 0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)

    def observe(self, value: float, exemplar: Exemplar | None = None) -> None:
        i = int(np.searchsorted(self.bounds, value, side="left"))  # bucket i: bounds[i-1] < v <= bounds[i]
        self.counts[i] += 1
        self.sum += value
        self.count += 1
        if exemplar is not None:
            self.exemplars[i] = exemplar

    def add_counts(self, counts: tuple[int, ...], total: float | None) -> None:
        """Add pre-aggregated bucket counts (same bounds; the last count is above the last bound)."""
        for i, c in enumerate(counts[: len(self.counts)]):
            self.counts[i] += c
        n = sum(counts)
        self.count += n
        self.sum += total if total is not None and math.isfinite(total) else math.nan

    def exemplify(self, value: float, exemplar: Exemplar) -> None:
        """Attach an exemplar to the bucket ``value`` falls in, without counting it again."""
        self.exemplars[int(np.searchsorted(self.bounds, value, side="left"))] = exemplar


__all__ = ["Hist"]
