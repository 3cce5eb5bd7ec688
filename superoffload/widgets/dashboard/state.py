"""Pure state behind the dashboard: spans, scalars and notes in, per-iteration points out.

No plotly, no ipywidgets, no threads: `DashboardState` is fed snapshots from a telemetry
recorder (or a list of spans) and keeps what the views draw; everything drawn is testable here.
Per-iteration numbers come from `superoffload.telemetry.metrics`, named and scaled by
`telemetry.vocabulary` (views never re-derive them), and only over COMPLETE iterations: an
iteration's CPU tail and its H2D copies may land while the next iteration runs, so iteration i
gets its point once iteration i + 2 has started (its weights were all needed by then) or when
the run is over (`final=True`).

A long run keeps its whole history: each per-iteration series is a `telemetry.binned.Binned`
(even bins whose stride doubles when full, each with its minimum and maximum), so iteration 0
and a one-iteration spike are still there after 100,000 iterations.

Several data-parallel ranks (spans with different `rank`): per-iteration series are kept per
rank (`history_by_rank`), the timeline gets one group of lane rows per rank, and the plotted
series is the lowest rank's.

Events kept beside the points: reconfigurations (the engine's "reconfigure applied: ..." and
"weights: ..." notes, at the iteration from which they hold), A/B trials of a change (their "A/B
..." notes; the switches inside one are part of it, not reconfigurations), skipped steps (notes
that say "step skipped", or a "skipped" scalar), rollbacks and replays (span kinds, counted
apart).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from superoffload.telemetry import metrics
from superoffload.telemetry import ranks as rank_util
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.archive import TIME_KEY, IterationArchive
from superoffload.telemetry.binned import Binned
from superoffload.telemetry.events import KIND_REPLAY, KIND_ROLLBACK, Span
from superoffload.telemetry.window import RECENT_ITERATIONS, WEIGHTS, Window, window_of

RECONFIGURE_PREFIXES = ("reconfigure applied", "weights:")
"""Engine notes that mark a change of settings (runtime/engine.py, runtime/weight_policy.py)."""
AB_PREFIX = "A/B"
"""Notes of an interleaved A/B start with it (runtime/ab_trial.py NOTE_PREFIX)."""
AB_STARTED = "A/B started"
SKIPPED_MARK = "step skipped"
"""The engine's note for a step skipped on a non-finite gradient (runtime/iteration.py)."""
SCALARS = ("loss", "ratio", "skipped")
"""The engine scalars `DashboardState.add_scalars` keeps (what a view feeds it)."""


@dataclass(frozen=True, slots=True)
class IterationPoint:
    """One complete iteration's figures (`vocabulary.PER_ITERATION`, in their units)."""

    iteration: int
    values: dict[str, float]
    moved_bytes: int
    """D2H + H2D bytes (0: the link panel has nothing to draw)."""
    metrics: metrics.IterationMetrics | None = None
    """What the figures were derived from: a window pools these (`telemetry.window`); None
    for a point fed without spans (each figure then weighs 1)."""

    @property
    def time_s(self) -> float:
        """Start of the iteration on the recorder's clock (NaN without metrics)."""
        return self.metrics.start_s if self.metrics is not None else math.nan


def iteration_points(spans: Sequence[Span]) -> list[IterationPoint]:
    """Per-iteration points (ascending) of ONE rank's spans."""
    return [IterationPoint(m.iteration, vocab.iteration_values(m), m.d2h_bytes + m.h2d_bytes, m)
            for m in metrics.iteration_metrics(spans)]


def _history(max_points: int) -> dict[str, Binned]:
    return {name: Binned(max_points) for name in (*vocab.PER_ITERATION, TIME_KEY)}


@dataclass
class TrialNotes:
    """An interleaved A/B of a settings change (runtime/ab_trial.py) as the notes
    tell it: from its start note to its result (or cancel) note; the switches between the
    old and new settings inside it are not separate reconfigurations."""

    start: int
    what: str
    """"ratio 0.5 -> 0.8": the change measured."""
    end: int | None = None
    result: str | None = None
    """The result line ("A/B measured: ..."), or why it ended without one."""
    switches: int = 0


@dataclass
class DashboardState:
    """Everything the measured dashboard draws, updated from recorder snapshots.

    The timeline keeps the last `window_iterations` iterations. Per-iteration series keep the
    whole run in at most `max_points` even bins each, with each bin's minimum and maximum
    (`telemetry.binned.Binned`); the last `recent_points` complete iterations are also kept as they
    are, for the status line's medians."""

    window_iterations: int = 6
    max_points: int = 600
    recent_points: int = 64
    spans_by_iteration: dict[int, list[Span]] = field(default_factory=dict)
    history_by_rank: dict[int, dict[str, Binned]] = field(default_factory=dict)
    """rank -> metric name -> bins (every per-iteration metric gets the same bins)."""
    recent_by_rank: dict[int, deque[IterationPoint]] = field(default_factory=dict)
    moved_bytes: int = 0
    loss: Binned = field(default_factory=Binned)
    ratio_changes: list[tuple[int, float]] = field(default_factory=list)
    """(first iteration, ratio) each time the engine's "ratio" scalar changed."""
    host_mem_gb: Binned = field(default_factory=Binned)
    device_mem_gb: Binned = field(default_factory=Binned)
    reconfigures: list[tuple[int, str]] = field(default_factory=list)
    ab_trials: list[TrialNotes] = field(default_factory=list)
    skipped: set[int] = field(default_factory=set)
    total_rollbacks: int = 0
    total_replays: int = 0
    spans_seen: int = 0
    complete_through: int = -1
    """Newest iteration whose point is final."""
    first_time_s: float | None = None
    """Start of the first iteration with a point (recorder seconds): 0 of the wall-clock axis."""
    lanes_seen: set[str] = field(default_factory=set)
    """Every lane the run has recorded work on: the timeline's rows (they never come and go
    between refreshes)."""
    _notes_seen: int = 0

    def __post_init__(self) -> None:
        if self.window_iterations < 1:
            raise ValueError(f"window_iterations={self.window_iterations} must be >= 1 "
                             "(iterations kept on the timeline)")
        if self.max_points < 10:
            raise ValueError(f"max_points={self.max_points} must be >= 10 (bins per series)")
        for b in (self.loss, self.host_mem_gb, self.device_mem_gb):
            b.max_bins = self.max_points

    # ------------------------------------------------------------------ feeding
    def add_spans(self, spans: Iterable[Span], *, final: bool = False) -> None:
        """Add new spans; give points to the iterations that became complete."""
        for s in spans:
            self.spans_by_iteration.setdefault(s.iteration, []).append(s)
            self.spans_seen += 1
            self.lanes_seen.add(s.lane)
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
                for p in iteration_points(rank_spans):
                    if self.complete_through < p.iteration <= through:
                        self.add_point(p, rank=rank)
            self.complete_through = through
        # the window, plus late spans' owners
        keep_from = newest - self.window_iterations - 3
        for i in [i for i in self.spans_by_iteration if i < keep_from]:
            del self.spans_by_iteration[i]

    def add_point(self, point: IterationPoint, *, rank: int = 0) -> None:
        """One complete iteration's figures (what `add_spans` derives; a test may feed
        thousands without spans)."""
        history = self.history_by_rank.get(rank)
        if history is None:
            history = self.history_by_rank[rank] = _history(self.max_points)
            self.recent_by_rank[rank] = deque(maxlen=self.recent_points)
        m = point.metrics
        if m is not None and (self.first_time_s is None or m.start_s < self.first_time_s):
            self.first_time_s = m.start_s
        for name, series in history.items():
            if name == TIME_KEY:
                series.add(point.iteration, point.time_s)
                continue
            weight = WEIGHTS[name](m) if m is not None else 1.0
            series.add(point.iteration, point.values.get(name, math.nan), weight)
        self.recent_by_rank[rank].append(point)
        self.moved_bytes += point.moved_bytes

    def add_archive(self, archive: IterationArchive) -> None:
        """The binned start of a run whose spans the recorder no longer holds (rank 0: a
        recorder's own), its loss too: merged bin into bin (`Binned.merge`)."""
        if archive.iterations == 0:
            return
        rank = 0
        history = self.history_by_rank.get(rank)
        if history is None:
            history = self.history_by_rank[rank] = _history(self.max_points)
            self.recent_by_rank[rank] = deque(maxlen=self.recent_points)
        for name, series in history.items():
            series.merge(archive.series[name])
        if "loss" in archive.scalars:
            self.loss.merge(archive.scalars["loss"])
        times = archive.series[TIME_KEY].arrays()["min"]
        if len(times) and (self.first_time_s is None or times[0] < self.first_time_s):
            self.first_time_s = float(times[0])
        self.complete_through = max(self.complete_through, archive.last_iteration)

    def add_scalars(self, name: str, values: Iterable[tuple[int, float]]) -> None:
        """The engine's per-iteration scalars: "loss" is drawn, "ratio" is tracked as changes,
        "skipped" (1.0 for a skipped step) marks skipped steps."""
        for iteration, value in values:
            it, v = int(iteration), float(value)
            if name == "loss":
                self.loss.add(it, v)
            elif name == "ratio":
                if not self.ratio_changes or self.ratio_changes[-1][1] != v:
                    self.ratio_changes.append((it, v))
            elif name == "skipped" and v:
                self.skipped.add(it)

    def add_notes(self, notes: Sequence[tuple[int, str]]) -> None:
        """All notes so far, oldest first (only the unseen tail is read)."""
        self.add_notes_since(notes[self._notes_seen:])

    def add_notes_since(self, notes: Sequence[tuple[int, str]]) -> None:
        """The notes recorded since the last call, oldest first."""
        for iteration, text in notes:
            it = int(iteration)
            # the switches of an A/B trial still open belong to it, not to the reconfigurations
            trial = None
            if self.ab_trials and self.ab_trials[-1].end is None:
                trial = self.ab_trials[-1]
            if text.startswith(AB_STARTED):
                what = text[len(AB_STARTED):].strip(" :").split(",")[0]
                self.ab_trials.append(TrialNotes(it, what))
            elif text.startswith(AB_PREFIX) and trial is not None:
                trial.end, trial.result = it, text
            elif text.startswith(RECONFIGURE_PREFIXES):
                if trial is not None:
                    trial.switches += 1
                else:
                    self.reconfigures.append((it, text))
            elif SKIPPED_MARK in text:
                self.skipped.add(it)
        self._notes_seen += len(notes)

    def add_memory(self, iteration: int, host_bytes: float | None,
                   device_bytes: float | None) -> None:
        """One memory sample, at the newest iteration (bytes; None when unknown)."""
        self.host_mem_gb.add(iteration, math.nan if host_bytes is None else host_bytes / 1e9)
        self.device_mem_gb.add(iteration, math.nan if device_bytes is None else device_bytes / 1e9)

    # ------------------------------------------------------------------ reading
    @property
    def newest_iteration(self) -> int:
        return max(self.spans_by_iteration, default=-1)

    @property
    def plotted_rank(self) -> int | None:
        """The rank whose series are drawn (the lowest), None before the first point."""
        return min(self.history_by_rank) if self.history_by_rank else None

    def timeline_spans(self) -> list[Span]:
        """Spans of the last `window_iterations` iterations, oldest first."""
        first = self.newest_iteration - self.window_iterations + 1
        return [s for i in sorted(self.spans_by_iteration) if i >= first
                for s in self.spans_by_iteration[i]]

    def ranks(self) -> list[int]:
        """Ranks on the timeline, ascending ([0] for a single-rank run)."""
        return rank_util.ranks_of(self.timeline_spans()) or [0]

    def _rank(self, rank: int | None) -> int | None:
        if rank is not None and rank not in self.history_by_rank:
            raise ValueError(f"rank={rank}: ranks seen are {sorted(self.history_by_rank)}")
        return self.plotted_rank if rank is None else rank

    def series(self, rank: int | None = None) -> dict[str, np.ndarray]:
        """The whole run's per-iteration series of `rank` (default: the lowest), one entry per
        bin: "iteration" (the bin's middle), "first", "last", "n" (iterations in the bin), and
        for each `vocabulary.PER_ITERATION` name its mean, plus "<name>_min" / "<name>_max"."""
        rank = self._rank(rank)
        if rank is None:
            empty = np.array([], dtype=float)
            out = {k: empty for k in ("iteration", "first", "last", "n", TIME_KEY)}
            for name in vocab.PER_ITERATION:
                out[name] = out[f"{name}_min"] = out[f"{name}_max"] = empty
            return out
        arrays = {name: series.arrays() for name, series in self.history_by_rank[rank].items()}
        # every metric has the same bins (add_point)
        grid = arrays["iteration_ms"]
        out = {"iteration": grid["x"], "first": grid["first"], "last": grid["last"], "n": grid["n"],
               TIME_KEY: arrays[TIME_KEY]["mean"]}
        for name in vocab.PER_ITERATION:
            a = arrays[name]
            out[name], out[f"{name}_min"], out[f"{name}_max"] = a["mean"], a["min"], a["max"]
        return out

    def recent_window(self, rank: int | None = None, count: int = RECENT_ITERATIONS) -> Window:
        """The last `count` complete iterations pooled (`telemetry.window`): the status
        line's figures, named by `Window.label()`."""
        rank = self._rank(rank)
        points = list(self.recent_by_rank.get(rank, ())) if rank is not None else []
        ms = [p.metrics for p in points[-count:] if p.metrics is not None]
        return window_of(ms)

    def recent(self, rank: int | None = None) -> dict[str, np.ndarray]:
        """The last `recent_points` complete iterations as they are: "iteration" and each
        per-iteration metric (for medians over the last iterations)."""
        rank = self._rank(rank)
        points = list(self.recent_by_rank.get(rank, ())) if rank is not None else []
        out = {"iteration": np.array([p.iteration for p in points], dtype=float)}
        for name in vocab.PER_ITERATION:
            out[name] = np.array([p.values.get(name, math.nan) for p in points], dtype=float)
        return out

    def coverage(self, rank: int | None = None) -> tuple[int, int, int] | None:
        """(first iteration, last iteration, iterations counted) of the per-iteration series,
        what a check compares with the recorder; None before the first complete iteration."""
        rank = self._rank(rank)
        if rank is None:
            return None
        grid = self.history_by_rank[rank]["iteration_ms"]
        first, last = grid.first_iteration, grid.last_iteration
        if first is None or last is None:
            return None
        return first, last, grid.count

    def stride(self, rank: int | None = None) -> int:
        """Iterations per bin of the per-iteration series now (1 until the bound is reached)."""
        rank = self._rank(rank)
        return self.history_by_rank[rank]["iteration_ms"].stride if rank is not None else 1

    def loss_series(self) -> dict[str, np.ndarray]:
        """The loss over the whole run (`Binned.arrays`: x, mean, min, max per bin)."""
        return self.loss.arrays()

    def memory_series(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(host GB, device GB) over the whole run (`Binned.arrays` each)."""
        return self.host_mem_gb.arrays(), self.device_mem_gb.arrays()

    def ratio_in_force(self) -> tuple[float, int] | None:
        """(ratio, first iteration it has held for), from the engine's "ratio" scalar."""
        if not self.ratio_changes:
            return None
        first, ratio = self.ratio_changes[-1]
        return ratio, first

    def available(self) -> frozenset[str]:
        """Measured panels that have data: "speed", "link", "percent", "loss", "memory"."""
        out = set()
        if self.plotted_rank is not None:
            out |= {"speed", "percent"}
        if self.moved_bytes:
            out.add("link")
        if self.loss.count:
            out.add("loss")
        if self.host_mem_gb.has_finite() or self.device_mem_gb.has_finite():
            out.add("memory")
        return frozenset(out)

    def has_device_memory(self) -> bool:
        return self.device_mem_gb.has_finite()

