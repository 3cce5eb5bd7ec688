"""A bounded per-iteration series that keeps the whole run: even bins whose stride doubles.

Why: a run of 6,000 iterations cannot send 6,000 points per line to a browser a few times a
second, and thinning "every other point of the older half" again and again (what the
dashboard did once) left iterations 0-4458 one point, so the loss read as a straight line.
Here every bin covers `stride` consecutive iterations (bin k holds iterations
[k*stride, (k+1)*stride)); when there are more than `max_bins` bins the stride doubles and
neighbours merge, so the whole run is always shown at one even step, between max_bins / 2
and max_bins bins. Each bin keeps the mean, the minimum and the maximum (and where they
occurred), so a one-iteration spike or dip survives any number of doublings: the min/max
envelope is what W&B's sampled charts and plotly-resampler's MinMax aggregation keep too.

Bins are aligned (a bin always starts at a multiple of its stride, a power of two), so two
series binned apart merge bin into bin (`merge`): the recorder's archive of the iterations
whose spans it no longer holds (telemetry/archive.py) joins the live series that way.

`arrays()` is what a view reads a few times a second: it rebuilds only the bins changed
since the last call (usually the newest one), so a refresh costs the changed bins plus one
copy of each column, not a pass over every bin in Python.

Pure (no plotly, no threads): `tests/test_widgets_history.py` feeds it past its bound.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

BIN_FIELDS = ("x", "mean", "min", "max", "first", "last", "n")
"""What `Binned.arrays()` returns per bin, in this order."""


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

    def copy(self) -> Bin:
        return Bin(self.first, self.last, self.n, self.finite, self.total, self.weight,
                   self.lo, self.lo_at, self.hi, self.hi_at)

    @property
    def mean(self) -> float:
        """Σ value x weight / Σ weight (NaN without a finite value of positive weight)."""
        return self.total / self.weight if self.weight > 0 else math.nan

    def row(self) -> tuple[float, ...]:
        """The bin's `BIN_FIELDS`."""
        ok = self.finite > 0
        return ((self.first + self.last) / 2, self.mean, self.lo if ok else math.nan,
                self.hi if ok else math.nan, float(self.first), float(self.last), float(self.n))


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
    _keys: list[int] = field(default_factory=list, repr=False)
    """The bin indices of the last `arrays()`, ascending (its rows, in order)."""
    _rows: np.ndarray | None = field(default=None, repr=False)
    """The last `arrays()` as one (bins, len(BIN_FIELDS)) block; None: rebuild it all."""
    _dirty: float = field(default=math.inf, repr=False)
    """The lowest bin index changed since the last `arrays()`."""
    _span: tuple[int, int] | None = field(default=None, repr=False)
    """(first, last) iteration added: kept as values arrive (a view asks every refresh)."""
    _finite: bool = field(default=False, repr=False)

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
        v = float(value)
        b.add(it, v, float(weight))
        self.count += 1
        self._span = (it, it) if self._span is None else (min(self._span[0], it),
                                                          max(self._span[1], it))
        self._finite = self._finite or not math.isnan(v)
        if key < self._dirty:
            self._dirty = key
        while len(self.bins) > self.max_bins:
            self._double()

    def merge(self, other: Binned) -> None:
        """Add every bin of `other` (another series of the same quantity, binned apart: the
        recorder's archive). Both strides are powers of two and bins start at multiples of
        them, so at the coarser stride each of `other`'s bins falls inside one of ours."""
        while self.stride < other.stride:
            self._double()
        for b in other.bins.values():
            key = b.first // self.stride
            mine = self.bins.get(key)
            if mine is None:
                self.bins[key] = b.copy()
            else:
                mine.merge(b)
            self.count += b.n
            self._span = ((b.first, b.last) if self._span is None else
                          (min(self._span[0], b.first), max(self._span[1], b.last)))
            self._finite = self._finite or b.finite > 0
        self._rows = None
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
        # every row moved: rebuild them all once
        self._rows = None

    def __len__(self) -> int:
        return len(self.bins)

    @property
    def first_iteration(self) -> int | None:
        return self._span[0] if self._span is not None else None

    @property
    def last_iteration(self) -> int | None:
        return self._span[1] if self._span is not None else None

    def has_finite(self) -> bool:
        return self._finite

    def arrays(self) -> dict[str, np.ndarray]:
        """Per bin, ascending: "x" (the middle of the iterations it holds: the iteration
        itself at stride 1), "mean", "min", "max", "first", "last", "n" (NaN statistics for a
        bin without a finite value). Only the bins changed since the last call are rebuilt."""
        keys = sorted(self.bins)
        if self._rows is None:
            cut = 0
        elif self._dirty == math.inf and keys == self._keys:
            return self._columns()
        else:
            # bins below the lowest changed one are as they were: a new bin is itself a
            # change, and no bin goes away without a doubling (which rebuilds every row)
            cut = min(bisect.bisect_left(keys, self._dirty), len(self._keys))
        fresh = np.array([self.bins[k].row() for k in keys[cut:]], dtype=float)
        fresh = fresh.reshape(len(keys) - cut, len(BIN_FIELDS))
        kept = self._rows[:cut] if self._rows is not None else np.empty((0, len(BIN_FIELDS)))
        self._rows = np.concatenate([kept, fresh]) if cut else fresh
        self._keys, self._dirty = keys, math.inf
        return self._columns()

    def _columns(self) -> dict[str, np.ndarray]:
        assert self._rows is not None
        return {name: self._rows[:, k].copy() for k, name in enumerate(BIN_FIELDS)}

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
