"""Which runs the dashboard compares with the live one, and their overlays, kept current.

A comparison is a list of sources: saved runs (`telemetry.runfile.SavedRun`, read from a
folder under runs/), recorders or span lists, and `compare.BEFORE_AFTER` (the live run's
iterations before and after its newest change of settings, as two runs). `overlays()` turns
them into `compare.Overlay`s; the before/after pair is re-cut from the recorder as the run
goes (at most every `RECUT_S` seconds: it reads the recording), the others once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from superoffload.telemetry.recorder import Recorder
from superoffload.telemetry.runfile import SavedRun, load_run, run_from_recorder, run_from_spans
from superoffload.widgets.compare import (
    BEFORE_AFTER,
    Overlay,
    change_window,
    check_count,
    overlay_of,
)
from superoffload.widgets.series import DashboardState

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
    spans = [s for s in recorder.spans() if b0 <= s.iteration <= a1 + 1]
    run = run_from_spans(spans, "live")
    return [overlay_of(run.segment(b0, b1, f"before {what} (it. {b0}-{b1})")),
            overlay_of(run.segment(a0, a1, f"after (it. {a0}-{a1})"))]
