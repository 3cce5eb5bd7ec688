"""Pure state behind the dashboard: spans and scalars in, plot-ready numpy arrays out.

No plotly, no ipywidgets, no threads: `DashboardState` is fed snapshots from a telemetry
recorder (or a simulated timeline) and answers "what should each trace show now". The
dashboard only copies these arrays into its figure, so everything drawn is testable here.

Per-iteration numbers (link GB/s each way, overlap, device idle) come from
`superoffload.telemetry.metrics`; the widgets never re-derive them (DESIGN.md §2: views only).

Several data-parallel ranks (spans with different `rank`, e.g. from
`telemetry.ranks.merge_rank_spans`): the timeline gets one group of lane rows per rank
("r0 D2H (grads out)", "r1 D2H (grads out)", ...), and per-iteration metrics are computed per
rank (`points_by_rank`); the plotted series is the lowest rank's. One rank draws as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from superoffload.telemetry import metrics
from superoffload.telemetry import ranks as rank_util
from superoffload.telemetry.events import KIND_REPLAY, KIND_ROLLBACK, LANES, Span

LANE_LABELS: dict[str, str] = {
    "device_compute": "device compute",
    "d2h": "D2H (grads out)",
    "cpu_optimizer": "CPU optimizer",
    "h2d": "H2D (weights in)",
    "device_optimizer": "device optimizer",
}
"""Display names of the lanes, in `LANES` order (top to bottom on the timeline)."""

ROLLBACK_KINDS = (KIND_ROLLBACK, KIND_REPLAY)
"""Span kinds marked on the timeline as the cost of a failed speculation (paper §4.3)."""


@dataclass(frozen=True, slots=True)
class Segments:
    """Spans of one lane as a single line trace: x = [start, end, NaN, ...] in seconds."""

    x_s: np.ndarray
    y: np.ndarray
    text: list[str]

    @property
    def count(self) -> int:
        """Number of spans drawn."""
        return len(self.text) // 3


@dataclass(frozen=True, slots=True)
class IterationPoint:
    """What the dashboard plots for one finished iteration (from `IterationMetrics`)."""

    iteration: int
    wall_s: float
    d2h_gbps: float
    """Bytes moved device->host / iteration time (`d2h_gbps_wall`)."""
    h2d_gbps: float
    d2h_gbps_busy: float
    """Rate while the link was moving (`d2h_gbps_busy`), shown on hover."""
    h2d_gbps_busy: float
    overlap_frac: float
    """Share of the CPU step hidden under device work (`cpu_overlap_frac`)."""
    device_idle_frac: float
    exposed_optimizer_s: float
    rollbacks: int


def span_segments(spans: Sequence[Span], lane_index: int,
                  rows: Sequence[int] | None = None) -> Segments:
    """Encode spans as one line trace with NaN breaks (one trace per lane keeps the figure
    at a fixed number of traces, which is what makes `batch_update` cheap). `rows` gives each
    span its own row (one row per rank and lane); default: all on `lane_index`."""
    n = len(spans)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    if n:
        x[0::3] = [s.start_s for s in spans]
        x[1::3] = [s.end_s for s in spans]
        y[0::3] = lane_index if rows is None else rows
        y[1::3] = lane_index if rows is None else rows
    text: list[str] = []
    for s in spans:
        label = f"{s.kind} it {s.iteration}"
        if rows is not None:
            label = f"r{s.rank} " + label
        if s.bucket >= 0:
            label += f" bucket {s.bucket}"
        label += f" · {s.duration_s * 1e3:.2f} ms"
        if s.nbytes:
            label += f" · {s.nbytes / 1e6:.2f} MB"
        text.extend((label, label, ""))
    return Segments(x, y, text)


def rollback_markers(spans: Iterable[Span], ranks: Sequence[int] = ()
                     ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Midpoints (x seconds, timeline row) and labels of rollback/replay spans; the row is the
    lane index, or the (rank, lane) row when several `ranks` share the timeline."""
    marks = [s for s in spans if s.kind in ROLLBACK_KINDS]
    x = np.array([(s.start_s + s.end_s) / 2 for s in marks], dtype=float)
    y = np.array([rank_util.row_index(s, list(ranks)) if len(ranks) > 1 else LANES.index(s.lane)
                  for s in marks], dtype=float)
    return x, y, [f"{s.kind} it {s.iteration} bucket {s.bucket}" for s in marks]


def iteration_points(spans: Sequence[Span]) -> list[IterationPoint]:
    """Per-iteration plot points (ascending) from `telemetry.metrics.iteration_metrics`."""
    return [
        IterationPoint(
            iteration=m.iteration,
            wall_s=m.wall_s,
            d2h_gbps=m.d2h_gbps_wall,
            h2d_gbps=m.h2d_gbps_wall,
            d2h_gbps_busy=m.d2h_gbps_busy,
            h2d_gbps_busy=m.h2d_gbps_busy,
            overlap_frac=m.cpu_overlap_frac,
            device_idle_frac=m.device_idle_frac,
            exposed_optimizer_s=m.exposed_optimizer_s,
            rollbacks=m.rollbacks + m.replays,
        )
        for m in metrics.iteration_metrics(spans)
    ]


@dataclass
class DashboardState:
    """Everything the dashboard draws, updated incrementally from recorder snapshots.

    The timeline keeps the last `window_iterations` iterations (a live figure must stay
    small: ~5 MB of JavaScript is already shipped once per FigureWidget); the per-iteration
    series and memory samples keep the newest `max_points` (every refresh re-sends them).
    """

    window_iterations: int = 6
    max_points: int = 500
    spans_by_iteration: dict[int, list[Span]] = field(default_factory=dict)
    points: dict[int, IterationPoint] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    ratio: dict[int, float] = field(default_factory=dict)
    memory_t_s: list[float] = field(default_factory=list)
    host_mem_gb: list[float] = field(default_factory=list)
    device_mem_gb: list[float] = field(default_factory=list)
    total_rollbacks: int = 0
    spans_seen: int = 0
    points_by_rank: dict[int, dict[int, IterationPoint]] = field(default_factory=dict)
    """Per-iteration points of every rank ({rank: {iteration: point}}); `points` is the
    lowest rank's."""

    def __post_init__(self) -> None:
        if self.window_iterations < 1:
            raise ValueError(
                f"window_iterations={self.window_iterations} must be >= 1 (iterations kept on the timeline)"
            )

    # ------------------------------------------------------------------ feeding
    def add_spans(self, spans: Iterable[Span], *, final: bool = False) -> None:
        """Add new spans and refresh the metrics of complete iterations.

        An iteration's window ends where the next one's compute starts, and its CPU tail may
        land after that (telemetry.metrics), so every kept iteration that has both its
        predecessor and a successor in memory is recomputed; `final` also closes the newest.
        """
        for s in spans:
            self.spans_by_iteration.setdefault(s.iteration, []).append(s)
            self.spans_seen += 1
            if s.kind in ROLLBACK_KINDS:
                self.total_rollbacks += 1
        if not self.spans_by_iteration:
            return
        kept = sorted(self.spans_by_iteration)
        newest = kept[-1]
        everything = [s for i in kept for s in self.spans_by_iteration[i]]
        # metrics per rank: one device and one CPU per rank (telemetry.ranks)
        for rank, rank_spans in rank_util.by_rank(everything).items():
            if not self.points_by_rank and rank == min(s.rank for s in everything):
                self.points_by_rank[rank] = self.points  # the lowest rank fills `points`
            points = self.points_by_rank.setdefault(rank, {})
            for p in iteration_points(rank_spans):
                has_prev = p.iteration > kept[0] or p.iteration not in points
                if (p.iteration < newest or final) and has_prev:
                    points[p.iteration] = p
        self.points = self.points_by_rank[min(self.points_by_rank)]
        self._trim(newest)

    def _trim(self, newest: int) -> None:
        # Keep span lists for the timeline window plus one (late spans of the previous
        # iteration are still being merged into its metrics).
        keep_from = newest - self.window_iterations
        for i in [i for i in self.spans_by_iteration if i < keep_from]:
            del self.spans_by_iteration[i]
        for points in self.points_by_rank.values() or [self.points]:
            while len(points) > self.max_points:
                del points[min(points)]

    def add_scalars(self, name: str, values: Iterable[tuple[int, float]]) -> None:
        """Per-iteration scalars the engine records: "loss" and "ratio" are drawn."""
        target = {"loss": self.loss, "ratio": self.ratio}.get(name)
        if target is None:
            return
        for iteration, value in values:
            target[int(iteration)] = float(value)

    def add_memory(self, t_s: float, host_bytes: float | None, device_bytes: float | None) -> None:
        """One memory sample (bytes; None when unknown, drawn as a gap)."""
        self.memory_t_s.append(float(t_s))
        self.host_mem_gb.append(np.nan if host_bytes is None else host_bytes / 1e9)
        self.device_mem_gb.append(np.nan if device_bytes is None else device_bytes / 1e9)
        if len(self.memory_t_s) > self.max_points:
            del self.memory_t_s[0], self.host_mem_gb[0], self.device_mem_gb[0]

    # ------------------------------------------------------------------ reading
    @property
    def newest_iteration(self) -> int:
        return max(self.spans_by_iteration, default=-1)

    def timeline_spans(self) -> list[Span]:
        """Spans of the last `window_iterations` iterations, oldest first."""
        newest = self.newest_iteration
        first = newest - self.window_iterations + 1
        return [
            s for i in sorted(self.spans_by_iteration) if i >= first for s in self.spans_by_iteration[i]
        ]

    def ranks(self) -> list[int]:
        """Ranks on the timeline, ascending ([0] for a single-rank run)."""
        return rank_util.ranks_of(self.timeline_spans()) or [0]

    def lane_labels(self) -> list[str]:
        """Timeline row labels, top to bottom: LANE_LABELS, prefixed "r{rank} " per rank when
        several ranks are drawn."""
        ranks = self.ranks()
        multi = len(ranks) > 1
        return [rank_util.lane_label(LANE_LABELS[lane], r, multi)
                for r, lane in rank_util.lane_rows(ranks)]

    def lane_segments(self) -> list[Segments]:
        """One `Segments` per lane (LANES order); with several ranks each span sits on its
        (rank, lane) row."""
        spans = self.timeline_spans()
        ranks = self.ranks()
        out = []
        for k, lane in enumerate(LANES):
            mine = [s for s in spans if s.lane == lane]
            rows = [rank_util.row_index(s, ranks) for s in mine] if len(ranks) > 1 else None
            out.append(span_segments(mine, k, rows))
        return out

    def series(self, rank: int | None = None) -> dict[str, np.ndarray]:
        """Per-iteration arrays named like `IterationPoint`'s fields (plus "iteration"), of
        `rank` (default: the lowest rank, i.e. `points`)."""
        if rank is not None and rank not in self.points_by_rank:
            raise ValueError(f"series(rank={rank}): ranks seen are {sorted(self.points_by_rank)}")
        source = self.points if rank is None else self.points_by_rank[rank]
        pts = [source[i] for i in sorted(source)]
        return {
            "iteration": np.array([p.iteration for p in pts], dtype=float),
            "d2h_gbps": np.array([p.d2h_gbps for p in pts], dtype=float),
            "h2d_gbps": np.array([p.h2d_gbps for p in pts], dtype=float),
            "d2h_gbps_busy": np.array([p.d2h_gbps_busy for p in pts], dtype=float),
            "h2d_gbps_busy": np.array([p.h2d_gbps_busy for p in pts], dtype=float),
            "overlap_frac": np.array([p.overlap_frac for p in pts], dtype=float),
            "device_idle_frac": np.array([p.device_idle_frac for p in pts], dtype=float),
            "wall_s": np.array([p.wall_s for p in pts], dtype=float),
            "exposed_optimizer_s": np.array([p.exposed_optimizer_s for p in pts], dtype=float),
        }

    def loss_series(self) -> tuple[np.ndarray, np.ndarray]:
        its = sorted(self.loss)
        return np.array(its, dtype=float), np.array([self.loss[i] for i in its], dtype=float)

    def ratio_in_force(self) -> tuple[float, int] | None:
        """(ratio, first iteration it has held for), from the engine's "ratio" scalar."""
        if not self.ratio:
            return None
        its = sorted(self.ratio)
        value = self.ratio[its[-1]]
        since = its[-1]
        for i in reversed(its):
            if self.ratio[i] != value:
                break
            since = i
        return value, since
