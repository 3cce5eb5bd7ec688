"""A bounded per-iteration series that keeps the whole run: even bins whose stride doubles.

Why: a run of 6,000 iterations cannot send 6,000 points per line to a browser a few times a
second, and thinning "every other point of the older half" again and again (what the
dashboard did before) left iterations 0-4458 one point, so the loss read as a straight line.
Here every bin covers `stride` consecutive iterations (bin k holds iterations
[k*stride, (k+1)*stride)); when there are more than `max_bins` bins the stride doubles and
neighbours merge, so the whole run is always shown at one even step, between max_bins / 2
and max_bins bins. Each bin keeps the mean, the minimum and the maximum (and where they
occurred), so a one-iteration spike or dip survives any number of doublings: the min/max
envelope is what W&B's sampled charts and plotly-resampler's MinMax aggregation keep too.

Pure (no plotly, no threads): `tests/test_widgets_history.py` feeds it past its bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Bin:
    """The iterations of one bin, reduced. NaN values count as present but are left out of
    the statistics (an iteration without CPU work has no "CPU step hidden"). The mean is
    weighted: with each iteration's denominator as its weight (`telemetry.window.WEIGHTS`)
    it is the bin's pooled figure, the same definition as every other view's."""

    first: int
    last: int
    n: int = 0
    finite: int = 0
    total: float = 0.0
    """Σ value x weight."""
    weight: float = 0.0
    """Σ weight (of the finite values)."""
    lo: float = math.inf
    lo_at: int = -1
    hi: float = -math.inf
    hi_at: int = -1

    def add(self, iteration: int, value: float, weight: float = 1.0) -> None:
        self.first = min(self.first, iteration)
        self.last = max(self.last, iteration)
        self.n += 1
        if math.isnan(value):
            return
        self.finite += 1
        self.total += value * weight
        self.weight += weight
        if value < self.lo:
            self.lo, self.lo_at = value, iteration
        if value > self.hi:
            self.hi, self.hi_at = value, iteration

    def merge(self, other: Bin) -> None:
        self.first = min(self.first, other.first)
        self.last = max(self.last, other.last)
        self.n += other.n
        self.finite += other.finite
        self.total += other.total
        self.weight += other.weight
        if other.lo < self.lo:
            self.lo, self.lo_at = other.lo, other.lo_at
        if other.hi > self.hi:
            self.hi, self.hi_at = other.hi, other.hi_at

    @property
    def mean(self) -> float:
        """Σ value x weight / Σ weight (NaN without a finite value of positive weight)."""
        return self.total / self.weight if self.weight > 0 else math.nan


@dataclass
class Binned:
    """One quantity over the whole run in at most `max_bins` even bins (module docstring)."""

    max_bins: int = 600
    stride: int = 1
    """Iterations per bin: 1, 2, 4, ... (doubles when the bins would exceed `max_bins`)."""
    bins: dict[int, Bin] = field(default_factory=dict)
    """Bin index (iteration // stride) -> bin."""
    count: int = 0
    """Values added over the run (every iteration, whatever the stride)."""

    def __post_init__(self) -> None:
        if self.max_bins < 4:
            raise ValueError(f"max_bins={self.max_bins} must be >= 4 (bins kept per series)")

    def add(self, iteration: int, value: float, weight: float = 1.0) -> None:
        """Add one iteration's value (any order; an iteration added twice counts twice) with
        its weight in the bin's mean (1: a plain mean)."""
        it = int(iteration)
        key = it // self.stride
        b = self.bins.get(key)
        if b is None:
            b = self.bins[key] = Bin(it, it)
        b.add(it, float(value), float(weight))
        self.count += 1
        while len(self.bins) > self.max_bins:
            self._double()

    def _double(self) -> None:
        merged: dict[int, Bin] = {}
        for key in sorted(self.bins):
            b = self.bins[key]
            into = merged.get(key // 2)
            if into is None:
                merged[key // 2] = b
            else:
                into.merge(b)
        self.bins = merged
        self.stride *= 2

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def first_iteration(self) -> int | None:
        return min((b.first for b in self.bins.values()), default=None)

    @property
    def last_iteration(self) -> int | None:
        return max((b.last for b in self.bins.values()), default=None)

    def has_finite(self) -> bool:
        return any(b.finite for b in self.bins.values())

    def arrays(self) -> dict[str, np.ndarray]:
        """Per bin, ascending: "x" (the middle of the iterations it holds: the iteration
        itself at stride 1), "mean", "min", "max", "first", "last", "n" (NaN statistics for a
        bin without a finite value)."""
        keys = sorted(self.bins)
        bins = [self.bins[k] for k in keys]
        def col(values: list[float]) -> np.ndarray:
            return np.array(values, dtype=float)
        return {
            "x": col([(b.first + b.last) / 2 for b in bins]),
            "mean": col([b.mean for b in bins]),
            "min": col([b.lo if b.finite else math.nan for b in bins]),
            "max": col([b.hi if b.finite else math.nan for b in bins]),
            "first": col([b.first for b in bins]),
            "last": col([b.last for b in bins]),
            "n": col([b.n for b in bins]),
        }

    def extreme(self, which: str = "max") -> tuple[int, float] | None:
        """(iteration, value) of the run's maximum (or "min"): kept exactly at any stride."""
        finite = [b for b in self.bins.values() if b.finite]
        if not finite:
            return None
        if which == "max":
            b = max(finite, key=lambda x: x.hi)
            return b.hi_at, b.hi
        if which == "min":
            b = min(finite, key=lambda x: x.lo)
            return b.lo_at, b.lo
        raise ValueError(f"extreme(which={which!r}): pass 'max' or 'min'")
