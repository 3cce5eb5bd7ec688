"""Pure state behind the dashboard: spans and scalars in, plot-ready numpy arrays out.

No plotly, no ipywidgets, no threads: `DashboardState` is fed snapshots from a telemetry
recorder (or a simulated timeline) and answers "what should each trace show now". The
dashboard only copies these arrays into its figure, so everything drawn is testable here.

Per-iteration numbers (link GB/s each way, overlap, device idle) come from
`superoffload.telemetry.metrics`; the widgets never re-derive them (DESIGN.md §2: views only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from superoffload.telemetry import metrics
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


def span_segments(spans: Sequence[Span], lane_index: int) -> Segments:
    """Encode spans as one line trace with NaN breaks (one trace per lane keeps the figure
    at a fixed number of traces, which is what makes `batch_update` cheap)."""
    n = len(spans)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    if n:
        x[0::3] = [s.start_s for s in spans]
        x[1::3] = [s.end_s for s in spans]
        y[0::3] = lane_index
        y[1::3] = lane_index
    text: list[str] = []
    for s in spans:
        label = f"{s.kind} it {s.iteration}"
        if s.bucket >= 0:
            label += f" bucket {s.bucket}"
        label += f" · {s.duration_s * 1e3:.2f} ms"
        if s.nbytes:
            label += f" · {s.nbytes / 1e6:.2f} MB"
        text.extend((label, label, ""))
    return Segments(x, y, text)


def rollback_markers(spans: Iterable[Span]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Midpoints (x seconds, lane index) and labels of rollback/replay spans."""
    marks = [s for s in spans if s.kind in ROLLBACK_KINDS]
    x = np.array([(s.start_s + s.end_s) / 2 for s in marks], dtype=float)
    y = np.array([LANES.index(s.lane) for s in marks], dtype=float)
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
        for p in iteration_points(everything):
            has_prev = p.iteration > kept[0] or p.iteration not in self.points
            if (p.iteration < newest or final) and has_prev:
                self.points[p.iteration] = p
        self._trim(newest)

    def _trim(self, newest: int) -> None:
        # Keep span lists for the timeline window plus one (late spans of the previous
        # iteration are still being merged into its metrics).
        keep_from = newest - self.window_iterations
        for i in [i for i in self.spans_by_iteration if i < keep_from]:
            del self.spans_by_iteration[i]
        while len(self.points) > self.max_points:
            del self.points[min(self.points)]

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

    def lane_segments(self) -> list[Segments]:
        spans = self.timeline_spans()
        return [span_segments([s for s in spans if s.lane == lane], k) for k, lane in enumerate(LANES)]

    def series(self) -> dict[str, np.ndarray]:
        """Per-iteration arrays named like `IterationPoint`'s fields (plus "iteration")."""
        pts = [self.points[i] for i in sorted(self.points)]
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
