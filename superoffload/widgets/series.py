"""Pure state behind the dashboard: spans, scalars and notes in, per-iteration points out.

No plotly, no ipywidgets, no threads: `DashboardState` is fed snapshots from a telemetry
recorder (or a list of spans) and keeps what the views draw; everything drawn is testable
here. Per-iteration numbers come from `superoffload.telemetry.metrics` (views never re-derive
them), and only over COMPLETE iterations: an iteration's CPU tail and its H2D copies may land
while the next iteration runs, so iteration i gets its point once iteration i + 2 has started
(its weights were all needed by then) or when the run is over (`final=True`).

Several data-parallel ranks (spans with different `rank`): per-iteration points are kept per
rank (`points_by_rank`), the timeline gets one group of lane rows per rank, and the plotted
series is the lowest rank's.

Events kept beside the points: reconfigurations (the engine's "reconfigure applied: ..." and
"weights: ..." notes, at the iteration from which they hold), skipped steps (notes that say
"step skipped", or a "skipped" scalar), rollbacks and replays (span kinds, counted apart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from superoffload.telemetry import metrics
from superoffload.telemetry import ranks as rank_util
from superoffload.telemetry.events import KIND_REPLAY, KIND_ROLLBACK, LANES, Span
from superoffload.widgets.timeline import LANE_LABELS

RECONFIGURE_PREFIXES = ("reconfigure applied", "weights:")
"""Engine notes that mark a change of settings (runtime/engine.py, runtime/weights.py)."""
SKIPPED_MARK = "step skipped"
"""The engine's note for a step skipped on a non-finite gradient (runtime/iteration.py)."""


@dataclass(frozen=True, slots=True)
class IterationPoint:
    """What the dashboard plots for one complete iteration (from `IterationMetrics`)."""

    iteration: int
    wall_s: float
    d2h_bytes: int
    h2d_bytes: int
    d2h_gbps_busy: float
    """Rate while the D2H lane moved bytes (NaN when it moved none)."""
    h2d_gbps_busy: float
    d2h_gbps_wall: float
    """Bytes / iteration time (what link utilisation is computed from)."""
    h2d_gbps_wall: float
    overlap_frac: float
    """Share of the CPU step hidden under device work (NaN without CPU work)."""
    device_idle_frac: float
    exposed_optimizer_s: float
    rollbacks: int
    replays: int


def iteration_points(spans: Sequence[Span]) -> list[IterationPoint]:
    """Per-iteration points (ascending) of ONE rank's spans."""
    nan = math.nan
    return [
        IterationPoint(
            iteration=m.iteration, wall_s=m.wall_s, d2h_bytes=m.d2h_bytes, h2d_bytes=m.h2d_bytes,
            d2h_gbps_busy=m.d2h_gbps_busy if m.d2h_bytes else nan,
            h2d_gbps_busy=m.h2d_gbps_busy if m.h2d_bytes else nan,
            d2h_gbps_wall=m.d2h_gbps_wall, h2d_gbps_wall=m.h2d_gbps_wall,
            overlap_frac=m.cpu_overlap_frac if m.cpu_step_s > 0 else nan,
            device_idle_frac=m.device_idle_frac, exposed_optimizer_s=m.exposed_optimizer_s,
            rollbacks=m.rollbacks, replays=m.replays,
        )
        for m in metrics.iteration_metrics(spans)
    ]


def thin(keys: Sequence[int], max_points: int) -> list[int]:
    """Keys to drop so at most `max_points` remain: every other key of the older half, so a
    long run keeps its whole history at a coarser step and the recent half at full detail."""
    ordered = sorted(keys)
    drop: list[int] = []
    while len(ordered) > max_points:
        gone = set(ordered[: len(ordered) // 2][1::2])
        drop.extend(sorted(gone))
        ordered = [k for k in ordered if k not in gone]
    return drop


@dataclass
class DashboardState:
    """Everything the measured dashboard draws, updated from recorder snapshots.

    The timeline keeps the last `window_iterations` iterations; per-iteration series keep at
    most `max_points` points each (older history thinned, see `thin`)."""

    window_iterations: int = 6
    max_points: int = 600
    spans_by_iteration: dict[int, list[Span]] = field(default_factory=dict)
    points_by_rank: dict[int, dict[int, IterationPoint]] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    ratio_changes: list[tuple[int, float]] = field(default_factory=list)
    """(first iteration, ratio) each time the engine's "ratio" scalar changed."""
    memory: dict[int, tuple[float, float]] = field(default_factory=dict)
    """iteration -> (host GB, device GB), NaN where unknown."""
    reconfigures: list[tuple[int, str]] = field(default_factory=list)
    skipped: set[int] = field(default_factory=set)
    total_rollbacks: int = 0
    total_replays: int = 0
    spans_seen: int = 0
    complete_through: int = -1
    """Newest iteration whose point is final."""
    _notes_seen: int = 0

    def __post_init__(self) -> None:
        if self.window_iterations < 1:
            raise ValueError(f"window_iterations={self.window_iterations} must be >= 1 "
                             "(iterations kept on the timeline)")
        if self.max_points < 10:
            raise ValueError(f"max_points={self.max_points} must be >= 10")

    # ------------------------------------------------------------------ feeding
    def add_spans(self, spans: Iterable[Span], *, final: bool = False) -> None:
        """Add new spans; give points to the iterations that became complete."""
        for s in spans:
            self.spans_by_iteration.setdefault(s.iteration, []).append(s)
            self.spans_seen += 1
            if s.kind == KIND_ROLLBACK:
                self.total_rollbacks += 1
            elif s.kind == KIND_REPLAY:
                self.total_replays += 1
        if not self.spans_by_iteration:
            return
        newest = max(self.spans_by_iteration)
        through = newest if final else newest - 2
        if through > self.complete_through:
            kept = [s for i in sorted(self.spans_by_iteration) for s in self.spans_by_iteration[i]]
            for rank, rank_spans in rank_util.by_rank(kept).items():
                points = self.points_by_rank.setdefault(rank, {})
                for p in iteration_points(rank_spans):
                    if self.complete_through < p.iteration <= through:
                        points[p.iteration] = p
                for k in thin(list(points), self.max_points):
                    del points[k]
            self.complete_through = through
        keep_from = newest - self.window_iterations - 3  # the window, plus late spans' owners
        for i in [i for i in self.spans_by_iteration if i < keep_from]:
            del self.spans_by_iteration[i]

    def add_scalars(self, name: str, values: Iterable[tuple[int, float]]) -> None:
        """The engine's per-iteration scalars: "loss" is drawn, "ratio" is tracked as changes,
        "skipped" (1.0 for a skipped step) marks skipped steps."""
        for iteration, value in values:
            it, v = int(iteration), float(value)
            if name == "loss":
                self.loss[it] = v
            elif name == "ratio":
                if not self.ratio_changes or self.ratio_changes[-1][1] != v:
                    self.ratio_changes.append((it, v))
            elif name == "skipped" and v:
                self.skipped.add(it)
        if name == "loss":
            for k in thin(list(self.loss), self.max_points):
                del self.loss[k]

    def add_notes(self, notes: Sequence[tuple[int, str]]) -> None:
        """All notes so far, oldest first (only the unseen tail is read)."""
        for iteration, text in notes[self._notes_seen:]:
            if text.startswith(RECONFIGURE_PREFIXES):
                self.reconfigures.append((int(iteration), text))
            elif SKIPPED_MARK in text:
                self.skipped.add(int(iteration))
        self._notes_seen = len(notes)

    def add_memory(self, iteration: int, host_bytes: float | None, device_bytes: float | None) -> None:
        """One memory sample, at the newest iteration (bytes; None when unknown)."""
        self.memory[int(iteration)] = (
            math.nan if host_bytes is None else host_bytes / 1e9,
            math.nan if device_bytes is None else device_bytes / 1e9,
        )
        for k in thin(list(self.memory), self.max_points):
            del self.memory[k]

    # ------------------------------------------------------------------ reading
    @property
    def newest_iteration(self) -> int:
        return max(self.spans_by_iteration, default=-1)

    @property
    def points(self) -> dict[int, IterationPoint]:
        """The lowest rank's points (the plotted ones)."""
        return self.points_by_rank[min(self.points_by_rank)] if self.points_by_rank else {}

    def timeline_spans(self) -> list[Span]:
        """Spans of the last `window_iterations` iterations, oldest first."""
        first = self.newest_iteration - self.window_iterations + 1
        return [s for i in sorted(self.spans_by_iteration) if i >= first
                for s in self.spans_by_iteration[i]]

    def ranks(self) -> list[int]:
        """Ranks on the timeline, ascending ([0] for a single-rank run)."""
        return rank_util.ranks_of(self.timeline_spans()) or [0]

    def lane_labels(self) -> list[str]:
        """Timeline row labels, top to bottom; "r{rank} ..." when several ranks are drawn."""
        ranks = self.ranks()
        multi = len(ranks) > 1
        return [rank_util.lane_label(LANE_LABELS[lane], r, multi)
                for r, lane in rank_util.lane_rows(ranks)]

    def series(self, rank: int | None = None) -> dict[str, np.ndarray]:
        """Per-iteration arrays of `rank` (default: the lowest): "iteration", "wall_ms",
        "d2h_gbps_busy", "h2d_gbps_busy", "d2h_gbps_wall", "h2d_gbps_wall", "overlap_pct",
        "idle_pct", "exposed_ms", "rollbacks", "replays"."""
        if rank is not None and rank not in self.points_by_rank:
            raise ValueError(f"series(rank={rank}): ranks seen are {sorted(self.points_by_rank)}")
        source = self.points if rank is None else self.points_by_rank[rank]
        pts = [source[i] for i in sorted(source)]

        def col(fn: Callable[[IterationPoint], float]) -> np.ndarray:
            return np.array([fn(p) for p in pts], dtype=float)

        return {
            "iteration": col(lambda p: p.iteration),
            "wall_ms": col(lambda p: p.wall_s * 1e3),
            "d2h_gbps_busy": col(lambda p: p.d2h_gbps_busy),
            "h2d_gbps_busy": col(lambda p: p.h2d_gbps_busy),
            "d2h_gbps_wall": col(lambda p: p.d2h_gbps_wall),
            "h2d_gbps_wall": col(lambda p: p.h2d_gbps_wall),
            "overlap_pct": col(lambda p: 100 * p.overlap_frac),
            "idle_pct": col(lambda p: 100 * p.device_idle_frac),
            "exposed_ms": col(lambda p: p.exposed_optimizer_s * 1e3),
            "rollbacks": col(lambda p: p.rollbacks),
            "replays": col(lambda p: p.replays),
        }

    def loss_series(self) -> tuple[np.ndarray, np.ndarray]:
        its = sorted(self.loss)
        return np.array(its, dtype=float), np.array([self.loss[i] for i in its], dtype=float)

    def memory_series(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        its = sorted(self.memory)
        return (np.array(its, dtype=float), np.array([self.memory[i][0] for i in its], dtype=float),
                np.array([self.memory[i][1] for i in its], dtype=float))

    def ratio_in_force(self) -> tuple[float, int] | None:
        """(ratio, first iteration it has held for), from the engine's "ratio" scalar."""
        return (self.ratio_changes[-1][1], self.ratio_changes[-1][0]) if self.ratio_changes else None

    def available(self) -> frozenset[str]:
        """Measured panels that have data: "speed", "link", "percent", "loss", "memory"."""
        out = set()
        pts = self.points
        if pts:
            out |= {"speed", "percent"}
        if any(p.d2h_bytes or p.h2d_bytes for p in pts.values()):
            out.add("link")
        if self.loss:
            out.add("loss")
        if any(not (math.isnan(h) and math.isnan(d)) for h, d in self.memory.values()):
            out.add("memory")
        return frozenset(out)

    def has_device_memory(self) -> bool:
        return any(not math.isnan(d) for _, d in self.memory.values())

    def lanes_present(self) -> list[str]:
        return [lane for lane in LANES if any(s.lane == lane for s in self.timeline_spans())]
