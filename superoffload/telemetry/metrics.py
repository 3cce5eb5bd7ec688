"""Derived metrics over a timeline of `Span`s: pure functions, so the engine's recorded
timeline and the planner's simulated one are measured the same way (DESIGN.md §2, §5).

Legend (per iteration i):
  window        [start of i's first device-compute span, start of i+1's first one); the last
                iteration ends at its last span's end
  wall_s        window length: the iteration time a user sees
  device busy   union of the device-compute and device-optimizer lanes' spans, minus the
                union of "wait" spans (the device blocked on another lane)
  model compute forward, backward and weight-fetch spans only, minus waits
  link GB/s     two readings per direction: `*_gbps_busy` = bytes / union of that lane's busy
                time (the rate the link achieved while moving), `*_gbps_wall` = bytes / wall_s
                (the rate averaged over the iteration; what the link costs the iteration)
  link utilisation
                `*_gbps_wall` / the link's reference rate, in percent (`link_utilisation_pct`;
                the rate is the planner's: a preset's peak, this machine's best measured
                copy, or a rate fitted to a run, which a measured rate can exceed)
  overlap       share of i's CPU-optimizer time that ran while the device computed
                (paper §4.2: the point of bucketization is to hide the CPU step behind backward)
  outside the engine
                the part of the window no lane worked in: the loop's own work (data loading,
                a framework's logging), which the planner does not model
  exposed optimizer time
                the part of [end of i's backward, end of i's last optimizer-side span (CPU
                step, H2D, device step, validation, rollback, replay)] during which the device
                did no model compute: the optimizer time the next forward waited for. For a
                ZeRO-Offload schedule it is the whole CPU step; SuperOffload aims to shrink it
                to the GPU tail step (paper §4.2, Fig. 5)
Several iterations are summed up as `telemetry.window` pools them (`Summary`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from superoffload.telemetry.events import (
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_REPLAY,
    KIND_ROLLBACK,
    KIND_VALIDATE,
    KIND_WAIT,
    KIND_WEIGHT_FETCH,
    LANE_COMPUTE,
    LANE_CPU,
    LANE_D2H,
    LANE_DEVICE_OPT,
    LANE_H2D,
    Span,
)
from superoffload.telemetry.intervals import (
    Disjoint,
    Interval,
    length,
    subtract,
    union,
)
from superoffload.telemetry.window import GB, window_values

__all__ = ["IterationMetrics", "Summary", "bandwidth_series", "device_busy", "iteration_metrics",
           "link_utilisation_pct", "model_compute", "spans_to_dataframe", "summarize",
           "summarize_metrics", "to_dataframe", "to_records"]

_COMPUTE_KINDS = (KIND_FORWARD, KIND_BACKWARD, KIND_WEIGHT_FETCH)
_OPTIMIZER_LANES = (LANE_CPU, LANE_H2D, LANE_DEVICE_OPT)
_OPTIMIZER_KINDS = (KIND_VALIDATE, KIND_ROLLBACK, KIND_REPLAY)


@dataclass(frozen=True, slots=True)
class IterationMetrics:
    """What one iteration did, derived from its spans (see the module legend)."""

    iteration: int
    start_s: float
    """Start of the iteration's window (its first device-compute span)."""
    wall_s: float
    """Length of the iteration's window: the iteration time."""
    compute_s: float
    """Device busy time inside the window (model compute and device optimizer, waits excluded)."""
    device_idle_frac: float
    """1 - compute_s / wall_s."""
    cpu_busy_s: float
    """Union of the CPU-optimizer lane's spans (any iteration's) inside the window."""
    cpu_busy_frac: float
    """cpu_busy_s / wall_s."""
    cpu_step_s: float
    """Union of this iteration's CPU-optimizer spans (wherever they fall)."""
    cpu_overlap_frac: float
    """cpu_hidden_s / cpu_step_s: the share that ran while the device was busy (1.0 when
    there was no CPU work; the vocabulary's figure is NaN then)."""
    exposed_optimizer_s: float
    """Optimizer time after backward during which the device did no model compute."""
    d2h_bytes: int
    h2d_bytes: int
    d2h_gbps_busy: float
    """d2h_bytes / union of this iteration's D2H spans (the rate while the link moved)."""
    h2d_gbps_busy: float
    d2h_gbps_wall: float
    """d2h_bytes / wall_s (the rate averaged over the iteration)."""
    h2d_gbps_wall: float
    rollbacks: int
    """Rollback spans (one per bucket rolled back)."""
    replays: int
    """Replay spans (one per bucket replayed with clipped gradients)."""
    d2h_busy_s: float = 0.0
    """Union of this iteration's D2H spans: the time the link moved its gradients."""
    h2d_busy_s: float = 0.0
    """Union of this iteration's H2D spans (weights back in, weight-flow fetches)."""
    outside_engine_s: float = 0.0
    """Time in the window during which no lane worked (any iteration's spans): the training
    loop's own work between steps (data loading, logging, a framework's bookkeeping)."""
    cpu_hidden_s: float = 0.0
    """The part of cpu_step_s that ran while the device was busy (what a window pools:
    `telemetry.window`)."""


def link_utilisation_pct(gbps_wall: float, peak_gbps: float | None) -> float:
    """100 x `gbps_wall` / `peak_gbps`: the share of the link's capacity one iteration used
    (NaN when the peak is unknown or not positive)."""
    if peak_gbps is None or not peak_gbps > 0:
        return math.nan
    return 100.0 * gbps_wall / peak_gbps


def device_busy(spans: Sequence[Span]) -> list[Interval]:
    """Intervals when the device worked (any non-wait span on the device-compute or
    device-optimizer lane: model compute, validation, the GPU tail step), minus waits."""
    work = [(s.start_s, s.end_s) for s in spans
            if s.lane in (LANE_COMPUTE, LANE_DEVICE_OPT) and s.kind != KIND_WAIT]
    waits = [(s.start_s, s.end_s) for s in spans
             if s.lane in (LANE_COMPUTE, LANE_DEVICE_OPT) and s.kind == KIND_WAIT]
    return subtract(work, waits)


def model_compute(spans: Sequence[Span]) -> list[Interval]:
    """Intervals of forward/backward (and weight-fetch) work on the device, minus waits."""
    work = [(s.start_s, s.end_s) for s in spans
            if s.lane == LANE_COMPUTE and s.kind in _COMPUTE_KINDS]
    waits = [(s.start_s, s.end_s) for s in spans if s.lane == LANE_COMPUTE and s.kind == KIND_WAIT]
    return subtract(work, waits)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else 0.0


@dataclass(slots=True)
class _Group:
    """One iteration's spans, sorted by what `iteration_metrics` asks of them (one pass)."""

    compute_start: float = math.inf
    last_end: float = -math.inf
    cpu: list[Interval] = field(default_factory=list)
    d2h: list[Interval] = field(default_factory=list)
    h2d: list[Interval] = field(default_factory=list)
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    backward_end: float = -math.inf
    optimizer_end: float = -math.inf
    rollbacks: int = 0
    replays: int = 0

    def add(self, s: Span) -> None:
        self.last_end = max(self.last_end, s.end_s)
        lane, kind = s.lane, s.kind
        if lane == LANE_COMPUTE:
            self.compute_start = min(self.compute_start, s.start_s)
            if kind == KIND_BACKWARD:
                self.backward_end = max(self.backward_end, s.end_s)
        elif lane == LANE_CPU:
            self.cpu.append((s.start_s, s.end_s))
        elif lane == LANE_D2H:
            self.d2h.append((s.start_s, s.end_s))
            self.d2h_bytes += s.nbytes
        elif lane == LANE_H2D:
            self.h2d.append((s.start_s, s.end_s))
            self.h2d_bytes += s.nbytes
        if lane in _OPTIMIZER_LANES or kind in _OPTIMIZER_KINDS:
            self.optimizer_end = max(self.optimizer_end, s.end_s)
        if kind == KIND_ROLLBACK:
            self.rollbacks += 1
        elif kind == KIND_REPLAY:
            self.replays += 1


def iteration_metrics(spans: Sequence[Span]) -> list[IterationMetrics]:
    """One `IterationMetrics` per iteration that has device-compute spans, ascending.
    Pass the whole timeline: an iteration's CPU work and the next forward overlap.

    O(n log n) in the number of spans: one pass groups them, the lanes' unions are built
    once (`Disjoint`), and each iteration asks them O(1) window queries of O(log n) each
    (a 10^5-span run must not take minutes: tests/test_metrics.py measures the growth)."""
    groups: dict[int, _Group] = {}
    for s in spans:
        g = groups.get(s.iteration)
        if g is None:
            g = groups[s.iteration] = _Group()
        g.add(s)
    order = sorted(it for it, g in groups.items() if g.compute_start < math.inf)
    busy = Disjoint(device_busy(spans))
    compute = Disjoint(model_compute(spans))
    cpu_all = Disjoint((s.start_s, s.end_s) for s in spans if s.lane == LANE_CPU)
    any_lane = Disjoint((s.start_s, s.end_s) for s in spans)
    out: list[IterationMetrics] = []
    for k, it in enumerate(order):
        g = groups[it]
        start = g.compute_start
        end = groups[order[k + 1]].compute_start if k + 1 < len(order) else g.last_end
        wall = max(end - start, 0.0)
        window = (start, end)
        compute_s = busy.length_in(window)
        cpu_busy_s = cpu_all.length_in(window)
        cpu_own = union(g.cpu)
        cpu_step_s = length(cpu_own)
        overlap_s = busy.overlap(cpu_own)
        exposed = 0.0
        if g.backward_end > -math.inf and g.optimizer_end > g.backward_end:
            tail = (g.backward_end, g.optimizer_end)
            exposed = (tail[1] - tail[0]) - compute.length_in(tail)
        d2h_busy, h2d_busy = length(g.d2h), length(g.h2d)
        out.append(
            IterationMetrics(
                iteration=it,
                start_s=start,
                wall_s=wall,
                compute_s=compute_s,
                device_idle_frac=1.0 - compute_s / wall if wall > 0 else 0.0,
                cpu_busy_s=cpu_busy_s,
                cpu_busy_frac=cpu_busy_s / wall if wall > 0 else 0.0,
                cpu_step_s=cpu_step_s,
                cpu_overlap_frac=overlap_s / cpu_step_s if cpu_step_s > 0 else 1.0,
                exposed_optimizer_s=max(exposed, 0.0),
                d2h_bytes=g.d2h_bytes,
                h2d_bytes=g.h2d_bytes,
                d2h_gbps_busy=_gbps(g.d2h_bytes, d2h_busy),
                h2d_gbps_busy=_gbps(g.h2d_bytes, h2d_busy),
                d2h_gbps_wall=_gbps(g.d2h_bytes, wall),
                h2d_gbps_wall=_gbps(g.h2d_bytes, wall),
                rollbacks=g.rollbacks,
                replays=g.replays,
                d2h_busy_s=d2h_busy,
                h2d_busy_s=h2d_busy,
                outside_engine_s=max(wall - any_lane.length_in(window), 0.0),
                cpu_hidden_s=overlap_s,
            )
        )
    return out


# ------------------------------------------------------------------ summaries and export


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's figures pooled over its iterations after `skip` warm-up ones
    (`telemetry.window`: totals over totals, the definition every view uses), and totals
    over all of them. Times are per iteration (seconds), rates GB/s, shares fractions."""

    iterations: int
    """Iterations in the timeline (totals count all of them)."""
    iterations_in_window: int
    """Iterations the pooled figures cover (after the skipped warm-up)."""
    wall_s: float
    compute_s: float
    device_idle_frac: float
    cpu_busy_frac: float
    cpu_overlap_frac: float
    """Pooled: CPU step time under device work / CPU step time (NaN: no CPU work)."""
    exposed_optimizer_s: float
    d2h_gbps_busy: float
    h2d_gbps_busy: float
    d2h_gbps_wall: float
    h2d_gbps_wall: float
    d2h_bytes_total: int
    h2d_bytes_total: int
    rollbacks_total: int
    replays_total: int
    first_in_window: int = -1
    """First and last iteration the pooled figures cover (the window a view names)."""
    last_in_window: int = -1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def window_label(self) -> str:
        """"iterations 1-299" (what the pooled figures cover)."""
        if self.first_in_window == self.last_in_window:
            return f"iteration {self.first_in_window}"
        return f"iterations {self.first_in_window}-{self.last_in_window}"


def summarize_metrics(metrics: Sequence[IterationMetrics], *, skip: int = 0) -> Summary:
    """Pooled figures over `metrics[skip:]` (all of them when fewer remain: the first
    iterations pay one-off costs), totals over all of `metrics` (a rollback in warm-up still
    happened)."""
    if skip < 0:
        raise ValueError(f"summarize: skip={skip} must be >= 0")
    ms = list(metrics[skip:]) or list(metrics)
    v = window_values(ms)
    return Summary(
        iterations=len(metrics),
        iterations_in_window=len(ms),
        wall_s=v["iteration_ms"] / 1e3,
        compute_s=sum(m.compute_s for m in ms) / len(ms) if ms else math.nan,
        device_idle_frac=v["device_idle_pct"] / 100.0,
        cpu_busy_frac=v["cpu_busy_pct"] / 100.0,
        cpu_overlap_frac=v["cpu_step_hidden_pct"] / 100.0,
        exposed_optimizer_s=v["exposed_optimizer_ms"] / 1e3,
        d2h_gbps_busy=v["d2h_gbps_busy"],
        h2d_gbps_busy=v["h2d_gbps_busy"],
        d2h_gbps_wall=v["d2h_gbps_wall"],
        h2d_gbps_wall=v["h2d_gbps_wall"],
        d2h_bytes_total=sum(m.d2h_bytes for m in metrics),
        h2d_bytes_total=sum(m.h2d_bytes for m in metrics),
        rollbacks_total=sum(m.rollbacks for m in metrics),
        replays_total=sum(m.replays for m in metrics),
        first_in_window=ms[0].iteration if ms else -1,
        last_in_window=ms[-1].iteration if ms else -1,
    )


def summarize(spans: Sequence[Span], *, skip: int = 0) -> Summary:
    """`summarize_metrics(iteration_metrics(spans), skip=skip)`."""
    return summarize_metrics(iteration_metrics(spans), skip=skip)


def bandwidth_series(
    spans: Sequence[Span], lane: str, *, bin_s: float | None = None
) -> tuple[list[float], list[float]]:
    """(bin start times, GB/s per bin) for one transfer lane, spreading each span's bytes
    uniformly over its duration. `bin_s` defaults to 1/200 of the timeline."""
    moves = [s for s in spans if s.lane == lane and s.nbytes > 0]
    if not spans:
        return [], []
    t0 = min(s.start_s for s in spans)
    t1 = max(s.end_s for s in spans)
    if t1 <= t0:
        return [], []
    if bin_s is None:
        bin_s = (t1 - t0) / 200
    if bin_s <= 0:
        raise ValueError(f"bandwidth_series: bin_s={bin_s!r} must be > 0")
    n = max(1, math.ceil((t1 - t0) / bin_s))
    moved = [0.0] * n
    for s in moves:
        dur = s.end_s - s.start_s
        if dur <= 0:
            moved[min(n - 1, int((s.start_s - t0) / bin_s))] += s.nbytes
            continue
        rate = s.nbytes / dur
        first, last = int((s.start_s - t0) / bin_s), min(n - 1, int((s.end_s - t0) / bin_s))
        for b in range(first, last + 1):
            lo, hi = t0 + b * bin_s, t0 + (b + 1) * bin_s
            moved[b] += rate * max(0.0, min(hi, s.end_s) - max(lo, s.start_s))
    return [t0 + b * bin_s for b in range(n)], [m / bin_s / GB for m in moved]


def to_records(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """Per-iteration metrics as plain dicts (JSON-safe), one per iteration."""
    return [asdict(m) for m in iteration_metrics(spans)]


def to_dataframe(spans: Sequence[Span]) -> Any:
    """Per-iteration metrics as a pandas DataFrame (pandas is optional: not a dependency)."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(
            "to_dataframe needs pandas (pip install pandas); to_records() gives plain dicts"
        ) from exc
    columns = [f.name for f in fields(IterationMetrics)]
    return pd.DataFrame.from_records(to_records(spans), columns=columns)


def spans_to_dataframe(spans: Sequence[Span]) -> Any:
    """The raw spans as a pandas DataFrame (one row per span)."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("spans_to_dataframe needs pandas (pip install pandas)") from exc
    return pd.DataFrame.from_records([s.to_dict() for s in spans])
