"""Interval algebra over [start, end) seconds: union, length, intersect, subtract, clip — the
pure tools telemetry/metrics.py measures timelines with (engine-recorded and simulated alike)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of [start, end] intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of `intervals`."""
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Union(a) ∩ union(b), as a sorted disjoint list."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        start = max(ua[i][0], ub[j][0])
        end = min(ua[i][1], ub[j][1])
        if end > start:
            out.append((start, end))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Union(a) minus union(b), as a sorted disjoint list. One merge pass over both sorted
    lists: `j` only moves forward, and an interval of b that covers several of a's is met
    once per interval of a that it ends (O(n log n) for the sorts, O(n) after)."""
    out: list[Interval] = []
    ub = union(b)
    j = 0
    for start, end in union(a):
        while j < len(ub) and ub[j][1] <= start:
            # b intervals wholly before this one (and before every later one)
            j += 1
        cur = start
        k = j
        while k < len(ub) and ub[k][0] < end:
            bs, be = ub[k]
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= end:
                break
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """`intervals` cut to `window`."""
    return intersect(intervals, [window])


class Disjoint:
    """A sorted disjoint interval list with O(log n) window queries: the timeline of a long
    run has ~10^5 spans and is queried a few times per iteration, so a query must not walk
    (or copy) the list. Two binary searches find the intervals a window touches; a prefix
    sum of their lengths gives the covered length without visiting them."""

    def __init__(self, intervals: Iterable[Interval]) -> None:
        self.items = union(intervals)
        self.starts = [s for s, _ in self.items]
        self.ends = [e for _, e in self.items]
        self.prefix = [0.0, *itertools.accumulate(e - s for s, e in self.items)]
        """prefix[k]: total length of items[:k]."""

    def _touching(self, window: Interval) -> tuple[int, int]:
        """(i, j): items[i:j] are the intervals with a part inside `window`."""
        lo, hi = window
        return bisect.bisect_right(self.ends, lo), bisect.bisect_left(self.starts, hi)

    def clip(self, window: Interval) -> list[Interval]:
        """The intervals' parts inside `window`, sorted (O(log n + parts))."""
        lo, hi = window
        i, j = self._touching(window)
        # a slice: O(j - i)
        out = [(max(s, lo), min(e, hi)) for s, e in self.items[i:j]]
        return [iv for iv in out if iv[1] > iv[0]]

    def length_in(self, window: Interval) -> float:
        """Length of self ∩ `window` (O(log n): a prefix sum less the two cut ends)."""
        lo, hi = window
        i, j = self._touching(window)
        if j <= i or hi <= lo:
            return 0.0
        total = self.prefix[j] - self.prefix[i]
        # the first interval starts before lo
        total -= max(0.0, lo - self.starts[i])
        # the last one ends after hi
        total -= max(0.0, self.ends[j - 1] - hi)
        return max(total, 0.0)

    def overlap(self, intervals: Iterable[Interval]) -> float:
        """Length of union(intervals) ∩ self."""
        return sum(self.length_in(iv) for iv in union(intervals))
