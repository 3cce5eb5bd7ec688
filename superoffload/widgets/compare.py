"""Runs overlaid on the dashboard's panels: saved runs beside the live one, and the
iterations before and after a change of settings (an Apply) as two runs on the same axes.

Each compared run becomes an `Overlay`: its per-iteration lines binned like the live ones
(`history.Binned`, weighted so each bin is pooled: `telemetry.window`), x counted from the
run's own start (iterations, or seconds of wall clock), so runs of different lengths or
started at different times line up at 0. The figure draws them in the metric's colour and
the run's line style (`layout.RUN_DASHES`). Pure: numbers in, arrays out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.metrics import IterationMetrics
from superoffload.telemetry.runfile import SavedRun
from superoffload.telemetry.window import WEIGHTS
from superoffload.widgets.history import Binned
from superoffload.widgets.series import ABTrial
from superoffload.widgets.traces import MAX_OVERLAYS, OVERLAY_METRICS

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


def change_window(state_reconfigures: Sequence[tuple[int, str]], trials: Sequence[ABTrial],
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
