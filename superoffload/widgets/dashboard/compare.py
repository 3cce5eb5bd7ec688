"""Runs drawn beside the live one: saved runs, and the live run's iterations before and after
its newest change of settings (an Apply) as two runs on the same axes.

A comparison is a list of sources: saved runs (`telemetry.runfile.SavedRun`, read from a
folder under runs/), recorders or span lists, and `BEFORE_AFTER`. Each compared run becomes
an `Overlay`: its per-iteration lines binned like the live ones (`telemetry.binned.Binned`,
weighted so each bin is pooled: `telemetry.window`), x counted from the run's own start
(iterations, or seconds of wall clock), so runs of different lengths or started at different
times line up at 0. The figure draws them in the metric's colour and the run's line style
(`layout.RUN_DASHES`). The before/after pair is re-cut from the recorder as the run goes (at
most every `RECUT_S` seconds, reading only the iterations it cuts), the others once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.binned import Binned
from superoffload.telemetry.metrics import IterationMetrics
from superoffload.telemetry.recorder import Recorder
from superoffload.telemetry.runfile import SavedRun, load_run, run_from_recorder, run_from_spans
from superoffload.telemetry.window import WEIGHTS
from superoffload.widgets.dashboard.state import DashboardState, TrialNotes
from superoffload.widgets.dashboard.traces import MAX_OVERLAYS, OVERLAY_METRICS

BEFORE_AFTER = "before/after the last change"
"""The comparison of the live run with itself around its newest change of settings."""
MAX_SEGMENT = 2000
"""At most this many iterations on each side of a change."""


@dataclass(frozen=True, slots=True)
class Overlay:
    """A compared run's lines: "x" (iterations since its start), "time" (seconds since its
    start) per bin of its metrics, and "loss_x" / "loss_time" / "loss" for its loss."""

    label: str
    arrays: dict[str, np.ndarray]

    @property
    def points(self) -> int:
        return len(self.arrays["x"])


def overlay_of(run: SavedRun, *, max_points: int = 600) -> Overlay:
    """The lines of `run` (module docstring)."""
    ms: Sequence[IterationMetrics] = run.metrics
    first = ms[0].iteration if ms else run.first_iteration
    t0 = ms[0].start_s if ms else 0.0
    grid = Binned(max_points)
    time = Binned(max_points)
    series = {name: Binned(max_points) for name, _ in OVERLAY_METRICS if name != "loss"}
    for m in ms:
        values = vocab.iteration_values(m)
        grid.add(m.iteration - first, 0.0)
        time.add(m.iteration - first, m.start_s - t0)
        for name, b in series.items():
            b.add(m.iteration - first, values[name], WEIGHTS[name](m))
    g = grid.arrays()
    out = {"x": g["x"], "time": time.arrays()["mean"]}
    for name, b in series.items():
        out[name] = b.arrays()["mean"]
    loss = Binned(max_points)
    for it, value in run.scalars.get("loss", []):
        loss.add(it - first, value)
    la = loss.arrays()
    out["loss_x"], out["loss"] = la["x"], la["mean"]
    # the loss at wall-clock time: where its iterations fall on the run's own clock
    out["loss_time"] = (np.interp(la["x"], g["x"], out["time"]) if len(g["x"]) and len(la["x"])
                        else np.full(len(la["x"]), np.nan))
    return Overlay(run.name, out)


def change_window(state_reconfigures: Sequence[tuple[int, str]], trials: Sequence[TrialNotes],
                  complete_through: int, first_iteration: int = 0
                  ) -> tuple[tuple[int, int], tuple[int, int], str] | None:
    """((first, last) before, (first, last) after, what changed) around the newest change:
    an A/B trial (before its start, after its end) or a reconfiguration; both sides equally
    long (at most `MAX_SEGMENT`); None before a change has complete iterations after it."""
    events: list[tuple[int, int, str]] = [(at, at, text.split(":", 1)[-1].strip())
                                           for at, text in state_reconfigures]
    events += [(t.start, t.end, t.what) for t in trials if t.end is not None]
    if not events:
        return None
    start, end, what = max(events, key=lambda e: e[0])
    length = min(start - first_iteration, complete_through - end, MAX_SEGMENT)
    if length < 1:
        return None
    return (start - length, start - 1), (end + 1, end + length), what


def check_count(count: int) -> None:
    if count > MAX_OVERLAYS:
        raise ValueError(f"{count} runs to compare: the dashboard overlays at most "
                         f"{MAX_OVERLAYS} beside the live one; pass fewer")


RECUT_S = 5.0
"""Seconds between two cuts of the live run around its change (the "after" side grows)."""


def as_run(source: Any, index: int) -> SavedRun:
    """A `SavedRun` from a folder path, a SavedRun, a Recorder, an engine or a list of spans."""
    if isinstance(source, SavedRun):
        return source
    if isinstance(source, (str, Path)):
        return load_run(source)
    if isinstance(source, Recorder):
        return run_from_recorder(source, f"run {index + 1}")
    recorder = getattr(source, "telemetry", None)
    if isinstance(recorder, Recorder):
        return run_from_recorder(recorder, type(source).__name__)
    if isinstance(source, Sequence):
        return run_from_spans(list(source), f"run {index + 1}")
    raise TypeError(f"compare: {type(source).__name__} is not a run: pass a folder under runs/ "
                    f"(save_run or `superoffload train`), a Recorder, an engine, spans, or "
                    f"{BEFORE_AFTER!r}")


class Comparison:
    """The compared runs of one dashboard (module docstring)."""

    def __init__(self) -> None:
        self.runs: list[SavedRun | str] = []
        """SavedRuns, and `BEFORE_AFTER` where the live run is cut around its change."""
        self._fixed: list[Overlay] = []
        self._cut: list[Overlay] = []
        self._cut_at = -float("inf")
        self._cut_through = -1

    def set(self, sources: Sequence[Any]) -> None:
        """Compare with `sources` (replacing the previous ones)."""
        runs: list[SavedRun | str] = [s if s == BEFORE_AFTER else as_run(s, k)
                                      for k, s in enumerate(sources)]
        check_count(sum(2 if r == BEFORE_AFTER else 1 for r in runs))
        self.runs = runs
        self._fixed = [overlay_of(r) for r in runs if isinstance(r, SavedRun)]
        self._cut, self._cut_at, self._cut_through = [], -float("inf"), -1

    @property
    def active(self) -> bool:
        return bool(self.runs)

    def labels(self) -> list[str]:
        return [r if isinstance(r, str) else r.name for r in self.runs]

    def overlays(self, recorder: Recorder | None, state: DashboardState) -> list[Overlay]:
        """The overlays now (the before/after pair re-cut when the run moved on)."""
        if BEFORE_AFTER in self.runs and recorder is not None:
            now = time.monotonic()
            if state.complete_through != self._cut_through and now - self._cut_at >= RECUT_S:
                self._cut = before_after(recorder, state)
                self._cut_at, self._cut_through = now, state.complete_through
        return [*self._cut, *self._fixed]


def before_after(recorder: Recorder, state: DashboardState) -> list[Overlay]:
    """The live run's iterations before and after its newest change, as two overlays (none
    before a change has complete iterations after it)."""
    cover = state.coverage()
    cut = change_window(state.reconfigures, state.ab_trials, state.complete_through,
                        first_iteration=cover[0] if cover is not None else 0)
    if cut is None:
        return []
    (b0, b1), (a0, a1), what = cut
    spans = [s for s in recorder.spans_from_iteration(b0) if s.iteration <= a1 + 1]
    run = run_from_spans(spans, "live")
    return [overlay_of(run.segment(b0, b1, f"before {what} (it. {b0}-{b1})")),
            overlay_of(run.segment(a0, a1, f"after (it. {a0}-{a1})"))]
