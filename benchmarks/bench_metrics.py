"""How the telemetry metrics scale with a run's length: `iteration_metrics` over 7k to 10^5
spans, the final static figure of a long run, and the old window query beside the new.

Before, `Disjoint.clip` copied the rest of the timeline on every window query and `subtract`
walked the whole second list for every interval of the first: quadratic, 138 s for a
57,576-span run (a five-minute notebook run), and the dashboard's final figure minutes late.
Here each size is timed best-of-`--repeats` in CPU seconds of this thread (`thread_time`:
another process's load does not count, as wall time on a shared 2-core machine does), with
the inputs moved out of the garbage collector's way (`gc.freeze`); the "x per 2x" column is
the ratio to the size half as big (2.0 is linear, 4.0 quadratic). The old algorithm is timed
in the same run, on the sizes it finishes in reasonable time, as the peer.

    .venv/bin/python benchmarks/bench_metrics.py                   # 7k .. 10^5 spans
    .venv/bin/python benchmarks/bench_metrics.py --repeats 5 --old-max 30000
"""

from __future__ import annotations

import argparse
import bisect
import gc
import time
from collections.abc import Callable, Iterable

from superoffload.telemetry import intervals
from superoffload.telemetry import metrics as M
from superoffload.telemetry.events import Span
from superoffload.telemetry.recorder import Recorder

SPANS_PER_ITERATION = 13


def timeline(iterations: int) -> list[Span]:
    """A SuperOffload-like schedule, 13 spans per iteration (tests/test_metrics_scale.py's)."""
    out: list[Span] = []
    t = 0.0
    for it in range(iterations):
        out += [Span("device_compute", "forward", t, t + 0.010, it),
                Span("device_compute", "backward", t + 0.010, t + 0.030, it)]
        for b in range(3):
            s = t + 0.012 + 0.005 * b
            out += [Span("d2h", "d2h", s, s + 0.002, it, b, 4_000_000),
                    Span("cpu_optimizer", "cpu_step", s + 0.002, s + 0.004 + 0.02 * (b == 2),
                         it, b),
                    Span("h2d", "h2d", s + 0.004, s + 0.005, it, b, 2_000_000)]
        out += [Span("device_compute", "wait", t + 0.030, t + 0.031, it),
                Span("device_optimizer", "device_step", t + 0.031, t + 0.032, it, 3)]
        t += 0.033
    return out


class OldDisjoint(intervals.Disjoint):
    """The window query as it was: a slice of every interval from the first one touched."""

    def clip(self, window: intervals.Interval) -> list[intervals.Interval]:
        lo, hi = window
        out: list[intervals.Interval] = []
        for start, end in self.items[bisect.bisect_right(self.ends, lo):]:
            if start >= hi:
                break
            out.append((max(start, lo), min(end, hi)))
        return [iv for iv in out if iv[1] > iv[0]]

    def length_in(self, window: intervals.Interval) -> float:
        return sum(e - s for s, e in self.clip(window))


def old_subtract(a: Iterable[intervals.Interval],
                 b: Iterable[intervals.Interval]) -> list[intervals.Interval]:
    """`subtract` as it was: every interval of a walks union(b) from its start."""
    out: list[intervals.Interval] = []
    ub = intervals.union(b)
    for start, end in intervals.union(a):
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


def old_iteration_metrics(spans: list[Span]) -> list[M.IterationMetrics]:
    """`iteration_metrics` with the old window queries and subtraction swapped in."""
    saved = M.Disjoint, M.subtract
    M.Disjoint, M.subtract = OldDisjoint, old_subtract  # type: ignore[misc]
    try:
        return M.iteration_metrics(spans)
    finally:
        M.Disjoint, M.subtract = saved  # type: ignore[misc]


def best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls, in CPU seconds of this thread."""
    times = []
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            times.append(time.thread_time() - t0)
    finally:
        gc.unfreeze()
    return min(times)


def static_figure_s(iterations: int) -> float:
    """The end-of-run static figure of a recorded run of `iterations` iterations (what replaces
    the live dashboard in place when the run ends)."""
    from superoffload.widgets.dashboard.dashboard import LiveDashboard

    rec = Recorder(max_events=SPANS_PER_ITERATION * iterations + 10)
    for s in timeline(iterations):
        rec.record(s)
    dash = LiveDashboard(rec, live=False)
    t0 = time.perf_counter()  # wall time: what a person waits for
    dash.static_figure()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old-max", type=int, default=15_000,
                        help="largest span count the old algorithm is timed on (it is quadratic)")
    args = parser.parse_args()
    iterations = [540, 1080, 2160, 4320, 8640]  # ~7k, 14k, 28k, 56k, 112k spans: each 2x
    runs = {n: timeline(n) for n in iterations}
    print("| spans | iteration_metrics (CPU s) | x per 2x | old algorithm (CPU s) | old / new |")
    print("|---:|---:|---:|---:|---:|")
    prev = None
    for n in iterations:
        spans = runs[n]
        new = best(lambda spans=spans: M.iteration_metrics(spans), args.repeats)
        old = (best(lambda spans=spans: old_iteration_metrics(spans), args.repeats)
               if len(spans) <= args.old_max else None)
        ratio = f"{new / prev:.2f}" if prev else "-"
        old_cell = f"{old:.3f}" if old is not None else "(not run)"
        vs = f"{old / new:.1f}x" if old is not None else "-"
        print(f"| {len(spans):,} | {new:.3f} | {ratio} | {old_cell} | {vs} |")
        prev = new
    print()
    print(f"static figure of a {iterations[-1]:,}-iteration run ({len(runs[iterations[-1]]):,} "
          f"spans): {static_figure_s(iterations[-1]):.2f} s of wall time")


if __name__ == "__main__":
    main()
