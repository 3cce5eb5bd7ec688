"""The arrays each trace of the measured figure shows: state in, {trace key: props} out.

Pure (numpy, no plotly): `figure.write_state` assigns them to the fixed traces. Per-iteration
lines are the history's bins (pooled values), smoothed when the view says so (the raw bin
value stays in the hover text and the min..max band); their x is the bin's iterations or its
wall-clock time (`XAxis`); compared runs fill their fixed slots (`compare.Overlay`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.widgets.dashboard.compare import Overlay
from superoffload.widgets.dashboard.options import ViewOptions
from superoffload.widgets.dashboard.smoothing import ema
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import Workload
from superoffload.widgets.dashboard.timeline import TimelineView, spaced_labels, vlines
from superoffload.widgets.dashboard.traces import EVENT_ROWS, MAX_OVERLAYS, OVERLAY_METRICS, TRACE

LINES = ("iteration_ms", "engine_ms", "d2h_gbps_busy", "h2d_gbps_busy", "cpu_step_hidden_pct",
         "device_idle_pct")
"""Per-iteration lines drawn from the history (each with its band but engine_ms)."""


@dataclass(frozen=True, slots=True)
class XAxis:
    """Where an iteration sits on the per-iteration panels: itself, or the seconds since the
    run's first iteration started (interpolated between the bins' mean start times)."""

    wall_clock: bool
    iterations: np.ndarray
    """The bins' middles (iterations)."""
    seconds: np.ndarray
    """The bins' mean start times, seconds since the run's start."""

    def of(self, iterations: Any) -> np.ndarray:
        its = np.asarray(iterations, dtype=float)
        if not self.wall_clock:
            return its
        if len(self.iterations) == 0:
            return np.full(its.shape, np.nan)
        return np.interp(its, self.iterations, self.seconds)

    def at(self, iteration: float) -> float:
        return float(self.of([iteration])[0]) if self.wall_clock else float(iteration)


def x_axis(state: DashboardState, arrays: dict[str, np.ndarray], view: ViewOptions) -> XAxis:
    start = state.first_time_s if state.first_time_s is not None else 0.0
    return XAxis(view.wall_clock, arrays["iteration"], arrays["time_s"] - start)


def custom(first: np.ndarray, last: np.ndarray, lo: np.ndarray, hi: np.ndarray,
           own: np.ndarray) -> np.ndarray:
    """Per bin: first and last iteration, minimum, maximum, the bin's own value (the hover
    template's fields, `traces.make_trace`)."""
    return np.column_stack([first, last, lo, hi, own]) if len(first) else np.empty((0, 5))


def band(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> dict[str, np.ndarray]:
    """A closed polygon along the maxima and back along the minima (bins without a finite
    value left out), drawn with fill="toself"."""
    ok = np.isfinite(lo) & np.isfinite(hi)
    x, lo, hi = x[ok], lo[ok], hi[ok]
    return {"x": np.concatenate([x, x[::-1]]), "y": np.concatenate([hi, lo[::-1]])}


def _line(x: np.ndarray, a: dict[str, np.ndarray], key: str, smoothing: float,
          first: np.ndarray, last: np.ndarray) -> dict[str, Any]:
    own = a[key]
    return {"x": x, "y": ema(own, smoothing) if smoothing else own,
            "customdata": custom(first, last, a[f"{key}_min"], a[f"{key}_max"], own)}


def timeline_updates(view: TimelineView) -> dict[str, dict[str, Any]]:
    up: dict[str, dict[str, Any]] = {}
    for lane, seg in view.lanes.items():
        up[f"lane:{lane}"] = {"x": seg.x_ms, "y": seg.y, "text": seg.text}
    bx, by = vlines(list(view.boundaries.values()), -1.0, view.rows - 0.5)
    up["boundary"] = {"x": bx, "y": by}
    starts = spaced_labels(view.boundaries, view.x_range_ms)
    up["boundary_text"] = {"x": np.array(list(starts.values()), dtype=float),
                           "y": np.full(len(starts), -0.68), "text": [f"it {i}" for i in starts]}
    marks = (("rollback", view.rollbacks), ("replay", view.replays), ("skipped", view.skipped))
    for key, m in marks:
        up[key] = {"x": m.x_ms, "y": m.y, "text": m.text}
    return up


def trace_updates(view: TimelineView, state: DashboardState, a: dict[str, np.ndarray],
                  work: Workload, top: float | None, options: ViewOptions,
                  overlays: Sequence[Overlay] = ()) -> dict[str, dict[str, Any]]:
    """Every trace's new arrays (keys of `traces.TRACE`)."""
    up = timeline_updates(view)
    xs = x_axis(state, a, options)
    x = xs.of(a["iteration"])
    w = options.smoothing
    for key in LINES:
        up[key] = _line(x, a, key, w, a["first"], a["last"])
        if f"{key}:band" in TRACE:
            up[f"{key}:band"] = band(x, a[f"{key}_min"], a[f"{key}_max"])
    pred = a["predicted_ms"]
    # a prediction has no spread: its hover's min, max and mean are the prediction itself
    up["predicted_ms"] = {"x": x, "y": pred,
                          "customdata": custom(a["first"], a["last"], pred, pred, pred)}
    strip = top or 1.0
    skipped = in_bins(state.skipped, a["first"], a["last"])
    for key, counts, label in (("rollback", a["rollbacks_max"], "bucket rollbacks"),
                               ("replay", a["replays_max"], "replays"),
                               ("skipped", skipped, "skipped steps")):
        sel = np.nan_to_num(counts) > 0
        total = a[key + "s"] * a["n"] if key != "skipped" else skipped
        up[f"speed_{key}"] = {
            "x": x[sel], "y": np.full(int(sel.sum()), EVENT_ROWS[key] * strip),
            "text": [f"it {int(f)}-{int(la)}: {int(round(n))} {label}"
                     for f, la, n in zip(a["first"][sel], a["last"][sel], total[sel])]}
    for d in ("d2h", "h2d"):
        peak = getattr(work, f"{d}_peak_gbps")
        up[f"{d}_peak"] = ({"x": np.array([x[0], x[-1]], dtype=float), "y": np.array([peak, peak])}
                           if len(x) and peak else {"x": np.array([]), "y": np.array([])})
    loss = state.loss_series()
    lx = xs.of(loss["x"])
    up["loss"] = {"x": lx, "y": ema(loss["mean"], w) if w else loss["mean"],
                  "customdata": custom(loss["first"], loss["last"], loss["min"], loss["max"],
                                       loss["mean"])}
    up["loss:band"] = band(lx, loss["min"], loss["max"])
    host, device = state.memory_series()
    up["host_mem_gb"] = {"x": xs.of(host["x"]), "y": host["mean"],
                         "customdata": custom(host["first"], host["last"], host["min"], host["max"],
                                              host["mean"])}
    has_device = state.has_device_memory()
    up["device_mem_gb"] = ({"x": xs.of(device["x"]), "y": device["mean"],
                            "customdata": custom(device["first"], device["last"], device["min"],
                                                 device["max"], device["mean"])}
                           if has_device else {"x": np.array([]), "y": np.array([]),
                                               "customdata": np.empty((0, 5))})
    up.update(overlay_updates(overlays, options))
    return up


def overlay_updates(overlays: Sequence[Overlay], options: ViewOptions) -> dict[str, dict[str, Any]]:
    """Each compared run's slot filled (named after the run), the unused slots emptied."""
    up: dict[str, dict[str, Any]] = {}
    empty = np.array([], dtype=float)
    for k in range(MAX_OVERLAYS):
        run = overlays[k] if k < len(overlays) else None
        for metric, _panel in OVERLAY_METRICS:
            if run is None:
                up[f"run{k}:{metric}"] = {"x": empty, "y": empty, "name": f"run {k + 1}"}
                continue
            a = run.arrays
            if metric == "loss":
                x, y = (a["loss_time"] if options.wall_clock else a["loss_x"]), a["loss"]
            else:
                x, y = (a["time"] if options.wall_clock else a["x"]), a[metric]
            up[f"run{k}:{metric}"] = {"x": x, "y": ema(y, options.smoothing) if options.smoothing
                                      else y, "name": run.label}
    return up


def in_bins(iterations: Iterable[int], first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """How many of `iterations` fall in each bin [first, last] (sorted once and searched: the
    cost grows with the bins and the events, not with their product)."""
    its = np.sort(np.fromiter(iterations, dtype=float))
    return (np.searchsorted(its, last, side="right")
            - np.searchsorted(its, first, side="left")).astype(float)


def same(trace: dict[str, Any], props: dict[str, Any]) -> bool:
    """True when the trace already shows these arrays (NaN-aware), texts and name."""
    for prop in ("x", "y", "customdata"):
        if prop not in props:
            continue
        old = trace.get(prop)
        new = np.asarray(props[prop], dtype=float)
        if old is None or np.shape(old) != new.shape or not np.array_equal(
                np.asarray(old, dtype=float), new, equal_nan=True):
            return False
    if "name" in props and trace.get("name") != props["name"]:
        return False
    return "text" not in props or list(trace.get("text") or ()) == list(props["text"])


def log_decades(arrays: list[np.ndarray],
                also: tuple[float | None, ...] = ()) -> list[float] | None:
    """A log axis' range in whole powers of ten around every finite positive value: a rate
    that barely changes stays a flat line with labelled ticks, instead of autoscaling its
    last digits into steps across an axis without a single label."""
    data = np.concatenate([np.asarray(a, dtype=float).ravel() for a in arrays] or [np.empty(0)])
    values = np.concatenate([data[np.isfinite(data) & (data > 0)],
                             np.array([float(v) for v in also if v], dtype=float)])
    if not len(values):
        return None
    lo, hi = np.floor(np.log10(values.min())), np.ceil(np.log10(values.max()))
    return [float(lo), float(max(hi, lo + 1))]
