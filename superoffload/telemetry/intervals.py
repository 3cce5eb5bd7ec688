"""Interval algebra over [start, end) seconds: union, length, intersect, subtract, clip — the
pure tools telemetry/metrics.py measures timelines with (engine-recorded and simulated alike)."""

from __future__ import annotations

import bisect
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
    """Union(a) minus union(b), as a sorted disjoint list."""
    out: list[Interval] = []
    ub = union(b)
    for start, end in union(a):
        cur = start
        for bs, be in ub:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """`intervals` cut to `window`."""
    return intersect(intervals, [window])


class Disjoint:
    """A sorted disjoint interval list with O(log n) window queries (the timeline of a long
    run has ~10^4 spans; clipping it once per iteration must not be quadratic)."""

    def __init__(self, intervals: Iterable[Interval]) -> None:
        self.items = union(intervals)
        self.ends = [e for _, e in self.items]

    def clip(self, window: Interval) -> list[Interval]:
        lo, hi = window
        out: list[Interval] = []
        for start, end in self.items[bisect.bisect_right(self.ends, lo):]:
            if start >= hi:
                break
            out.append((max(start, lo), min(end, hi)))
        return [iv for iv in out if iv[1] > iv[0]]

    def length_in(self, window: Interval) -> float:
        return sum(e - s for s, e in self.clip(window))

    def overlap(self, intervals: Iterable[Interval]) -> float:
        """Length of union(intervals) ∩ self."""
        return sum(self.length_in(iv) for iv in union(intervals))


# ------------------------------------------------------------------ per-iteration metrics
