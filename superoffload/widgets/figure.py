"""The measured dashboard's plotly figure: a fixed set of traces, written from pure state.

Panels and their places come from `layout` (timeline on top, per-iteration panels below on
one shared x axis of iterations); the traces from `traces`; the arrays from `series`,
`timeline` and `panels`. Traces are created once, in a fixed order (`TRACE`), each bound to
its panel's axes for good, so a refresh assigns arrays to existing traces (`write_state` says
whether anything changed) and, when a panel gains its first data, moves the axes' domains
(no panel is drawn before it has data; until the first complete iteration the timeline says
it is waiting). Width follows the output area (autosize + responsive); every panel has its
own one-line legend above it and axis titles with units. The same figure is the HTML
report's (`widgets/report.py`), so both read the same.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from superoffload.telemetry.events import LANES
from superoffload.widgets import layout as L
from superoffload.widgets.panels import Expected, Workload, measured_arrays, robust_top
from superoffload.widgets.series import ABTrial, DashboardState
from superoffload.widgets.timeline import TimelineView, spaced_labels, timeline_view, vlines
from superoffload.widgets.traces import EVENT_ROWS, SPECS, TRACE, legend_name, make_trace, rgba

__all__ = ["FONT", "PLOT_CONFIG", "SPECS", "TRACE", "WAITING", "build_figure", "write_state"]

PLOT_CONFIG: dict[str, Any] = {"responsive": True, "displaylogo": False}
FONT = {"family": "Arial, Helvetica, sans-serif", "size": 12}
WAITING = "waiting for the first complete iteration"


def build_figure(*, title: str = "superoffload") -> Any:
    """The measured layout's go.Figure, every trace in place and empty (a live view sends it
    to the browser with `liveplot.LivePlot`)."""
    import plotly.graph_objects as go

    fig = go.Figure(data=[make_trace(go, s) for s in SPECS])
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 14}},
        autosize=True, height=L.TIMELINE_PX + 200, font=FONT, hovermode="closest",
        margin={"l": 64, "r": 16, "t": L.TOP_PX, "b": 36}, uirevision="superoffload",
        plot_bgcolor="#FAFAFA",
    )
    _apply_grid(fig, L.measured_panels(frozenset()))
    return fig


def _apply_grid(fig: Any, panels: list[str], x_title: str = "iteration") -> None:
    """Place the axes and legends of `panels`; hide the others (titles: `panel_annotations`)."""
    grid = L.grid(panels)
    fig.layout.height = grid.height_px
    for key, suffix in L.AXIS.items():
        xa, ya = f"xaxis{suffix}", f"yaxis{suffix}"
        dom = grid.domains.get(key)
        panel = L.MEASURED[key]
        if dom is None:
            fig.layout[xa] = {"visible": False, "domain": [0, 0.01]}
            fig.layout[ya] = {"visible": False, "domain": [0, 0.01]}
            fig.layout[legend_name(key)] = {"visible": False}
            continue
        xprops: dict[str, Any] = {"visible": True, "domain": list(dom.x), "anchor": f"y{suffix}",
                                  "showgrid": True, "zeroline": False}
        yprops: dict[str, Any] = {"visible": True, "domain": list(dom.y), "anchor": f"x{suffix}",
                                  "title": {"text": panel.y_title}, "automargin": True}
        if key != "timeline":
            xprops["title"] = {"text": x_title if key in grid.bottom_row else ""}
            if key != "speed":
                xprops["matches"] = "x2"  # one x axis of iterations for every panel below
            yprops["rangemode"] = "tozero"
        if key == "percent":
            yprops["range"] = [0, 105]
        if key == "link":  # rates far below the peak (a CPU "link") stay readable beside it
            yprops["type"] = "log"
            yprops["dtick"] = 1  # a label per power of ten
            yprops.pop("rangemode")
        fig.layout[xa] = xprops
        fig.layout[ya] = yprops
        px = 1.0 / grid.height_px
        fig.layout[legend_name(key)] = {
            "visible": True, "orientation": "h", "x": dom.x[0], "xanchor": "left",
            "y": dom.y[1] + 4 * px, "yanchor": "bottom", "font": {"size": 11},
            "bgcolor": "rgba(0,0,0,0)", "itemclick": "toggle", "tracegroupgap": 0}


def panel_annotations(panels: list[str], titles: dict[str, str], marks: list[tuple[int, str]],
                      *, waiting: bool = False, trials: list[ABTrial] | None = None
                      ) -> list[dict[str, Any]]:
    """Panel titles above each panel; a label per reconfiguration (the newest three) at the
    bottom of the iteration-time panel beside its dashed line, on an opaque box (a spike
    never crosses it: the line is above the axis' zero); "waiting for the first complete
    iteration" across the timeline until there is one."""
    grid = L.grid(panels)
    px = 1.0 / grid.height_px
    out: list[dict[str, Any]] = []
    for key in panels:
        dom = grid.domains[key]
        out.append({"text": f"<b>{titles.get(key, L.MEASURED[key].title)}</b>", "showarrow": False,
                    "xref": "paper", "yref": "paper", "x": dom.x[0], "y": dom.y[1] + 28 * px,
                    "xanchor": "left", "yanchor": "bottom", "font": {"size": 12}})
    if "speed" in panels:
        color = L.EVENT_COLORS["reconfigure"]
        labels = [(at, short_change(text)) for at, text in marks]
        labels += [(t.start, "A/B " + short_change(t.what)) for t in trials or ()]
        for at, text in sorted(labels)[-3:]:
            out.append({"text": text, "showarrow": False, "xref": "x2",
                        "yref": "y2 domain", "x": at, "y": 0.02, "xanchor": "left",
                        "yanchor": "bottom", "font": {"size": 10, "color": color},
                        "bgcolor": "#FFFFFF", "bordercolor": color, "borderwidth": 1, "borderpad": 2})
    if waiting:
        out.append({"text": WAITING, "showarrow": False, "xref": "x domain", "yref": "y domain",
                    "x": 0.5, "y": 0.5, "font": {"size": 14, "color": "#555555"},
                    "bgcolor": "#FFFFFF"})
    return out


def short_change(note: str) -> str:
    """"reconfigure applied: ratio 0.5 -> 0.8" -> "ratio 0.5→0.8"."""
    text = note.split(":", 1)[1].strip() if note.startswith("reconfigure applied") else note
    return text.replace(" -> ", "→")


def write_state(fig: Any, state: DashboardState, title: str, *, work: Workload | None = None,
                expected: tuple[Expected, ...] | list[Expected] = ()) -> bool:
    """Copy the state's arrays into the figure's traces and layout (in one batch on a
    FigureWidget); True when anything changed."""
    work = work or Workload()
    view = timeline_view(state.timeline_spans(), skipped=state.skipped,
                         reconfigures=state.reconfigures)
    arrays = measured_arrays(state, work, expected)
    panels = L.measured_panels(state.available())
    top = robust_top(arrays["iteration_ms"], also=arrays["predicted_ms"])
    updates = _trace_updates(view, state, arrays, work, top)
    stride = state.stride()
    x_title = "iteration" if stride == 1 else f"iteration (bins of {stride}: line = mean, band = min..max)"
    changed = False
    batch = fig.batch_update() if hasattr(fig, "batch_update") else contextlib.nullcontext()
    with batch:
        shown = [k for k, s in L.AXIS.items() if fig.layout[f"xaxis{s}"].visible]
        bottom = [fig.layout[f"xaxis{L.AXIS[k]}"].title.text for k in shown if k != "timeline"]
        if shown != panels or (bottom and x_title not in bottom):
            _apply_grid(fig, panels, x_title)
            changed = True
        for key, props in updates.items():
            trace = fig.data[TRACE[key]]
            if _same(trace, props):
                continue  # nothing new: send nothing to the browser
            changed = True
            for prop, value in props.items():
                setattr(trace, prop, value)
        if fig.layout.title.text != title:
            fig.layout.title.text = title
            changed = True
        axis = fig.layout.yaxis
        if list(axis.ticktext or ()) != view.labels:
            changed = True
            axis.tickvals = list(range(view.rows))
            axis.ticktext = view.labels
            axis.range = [view.rows - 0.5, -0.7]  # reversed: compute on top; room for "it N"
            axis.zeroline = False
        first = min(view.boundaries, default=None)
        titles = {"timeline": "timeline · ms since iteration "
                              f"{first} started" if first is not None else "timeline · waiting "
                              "for the first iteration"}
        notes = panel_annotations(panels, titles, state.reconfigures,
                                  waiting=state.plotted_rank is None, trials=state.ab_trials)
        if [a.to_plotly_json() for a in fig.layout.annotations] != notes:
            fig.layout.annotations = notes
            changed = True
        old = fig.layout.yaxis2.range
        if top is not None and (old is None or abs(old[1] - top) > 0.1 * top):
            fig.layout.yaxis2.range = [0, top]  # a step only when it moves by > 10 %
            changed = True
        decades = log_decades([arrays[k] for k in ("d2h_gbps_busy_min", "d2h_gbps_busy_max",
                                                   "h2d_gbps_busy_min", "h2d_gbps_busy_max")],
                              also=(work.d2h_peak_gbps, work.h2d_peak_gbps))
        if decades is not None and list(fig.layout.yaxis3.range or ()) != decades:
            fig.layout.yaxis3.range = decades
            changed = True
        shapes = reconfigure_shapes(state, view, panels)
        if [dict(s.to_plotly_json()) for s in fig.layout.shapes] != shapes:
            fig.layout.shapes = shapes
            changed = True
    return changed


def log_decades(arrays: list[np.ndarray], also: tuple[float | None, ...] = ()) -> list[float] | None:
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


def _custom(a: dict[str, np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per bin: first and last iteration (`a`'s), minimum, maximum (the hover template's
    fields, `traces.make_trace`)."""
    return np.column_stack([a["first"], a["last"], lo, hi]) if len(a["first"]) else np.empty((0, 4))


def _band(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> dict[str, np.ndarray]:
    """A closed polygon along the maxima and back along the minima (bins without a finite
    value left out), drawn with fill="toself"."""
    ok = np.isfinite(lo) & np.isfinite(hi)
    x, lo, hi = x[ok], lo[ok], hi[ok]
    return {"x": np.concatenate([x, x[::-1]]), "y": np.concatenate([hi, lo[::-1]])}


def _trace_updates(view: TimelineView, state: DashboardState, a: dict[str, np.ndarray],
                   work: Workload, top: float | None) -> dict[str, dict[str, Any]]:
    up: dict[str, dict[str, Any]] = {}
    for lane, seg in zip(LANES, view.lanes):
        up[f"lane:{lane}"] = {"x": seg.x_ms, "y": seg.y, "text": seg.text}
    bx, by = vlines(list(view.boundaries.values()), -0.7, view.rows - 0.5)
    up["boundary"] = {"x": bx, "y": by}
    starts = spaced_labels(view.boundaries, view.x_range_ms)
    up["boundary_text"] = {"x": np.array(list(starts.values()), dtype=float),
                           "y": np.full(len(starts), -0.45), "text": [f"it {i}" for i in starts]}
    for key, m in (("rollback", view.rollbacks), ("replay", view.replays), ("skipped", view.skipped)):
        up[key] = {"x": m.x_ms, "y": m.y, "text": m.text}
    it = a["iteration"]
    for key in ("iteration_ms", "engine_ms", "d2h_gbps_busy", "h2d_gbps_busy",
                "cpu_step_hidden_pct", "device_idle_pct"):
        up[key] = {"x": it, "y": a[key], "customdata": _custom(a, a[f"{key}_min"], a[f"{key}_max"])}
        if f"{key}:band" in TRACE:
            up[f"{key}:band"] = _band(it, a[f"{key}_min"], a[f"{key}_max"])
    pred = a["predicted_ms"]
    up["predicted_ms"] = {"x": it, "y": pred, "customdata": _custom(a, pred, pred)}
    strip = (top or 1.0)
    skipped = np.array([sum(1 for s in state.skipped if f <= s <= la)
                        for f, la in zip(a["first"], a["last"])], dtype=float)
    for key, counts, label in (("rollback", a["rollbacks_max"], "bucket rollbacks"),
                               ("replay", a["replays_max"], "replays"),
                               ("skipped", skipped, "skipped steps")):
        sel = np.nan_to_num(counts) > 0
        total = a[key + "s"] * a["n"] if key != "skipped" else skipped
        up[f"speed_{key}"] = {
            "x": it[sel], "y": np.full(int(sel.sum()), EVENT_ROWS[key] * strip),
            "text": [f"it {int(f)}-{int(la)}: {int(round(n))} {label}"
                     for f, la, n in zip(a["first"][sel], a["last"][sel], total[sel])]}
    for d in ("d2h", "h2d"):
        peak = getattr(work, f"{d}_peak_gbps")
        up[f"{d}_peak"] = ({"x": np.array([it[0], it[-1]], dtype=float), "y": np.array([peak, peak])}
                           if len(it) and peak else {"x": np.array([]), "y": np.array([])})
    loss = state.loss_series()
    up["loss"] = {"x": loss["x"], "y": loss["mean"], "customdata": _custom(loss, loss["min"], loss["max"])}
    up["loss:band"] = _band(loss["x"], loss["min"], loss["max"])
    host, device = state.memory_series()
    up["host_mem_gb"] = {"x": host["x"], "y": host["mean"],
                         "customdata": _custom(host, host["min"], host["max"])}
    has_device = state.has_device_memory()
    up["device_mem_gb"] = {"x": device["x"] if has_device else np.array([]),
                           "y": device["mean"] if has_device else np.array([]),
                           "customdata": _custom(device, device["min"], device["max"]) if has_device
                           else np.empty((0, 4))}
    return up


def reconfigure_shapes(state: DashboardState, view: TimelineView, panels: list[str]) -> list[dict[str, Any]]:
    """A dashed vertical line at each reconfiguration: on every per-iteration panel at its
    iteration, and on the timeline at the iteration's start when it is in the window. An A/B
    trial is a light band over its iterations on every per-iteration panel (the switches
    inside it are not drawn one by one), up to the newest complete iteration while it runs."""
    color = L.EVENT_COLORS["reconfigure"]
    line = {"color": color, "width": 1.5, "dash": "dash"}
    out: list[dict[str, Any]] = []
    for t in state.ab_trials:
        end = t.end if t.end is not None else max(state.complete_through, t.start)
        for key in panels:
            if key == "timeline":
                continue
            suffix = L.AXIS[key]
            out.append({"type": "rect", "xref": f"x{suffix}", "yref": f"y{suffix} domain",
                        "x0": t.start, "x1": end, "y0": 0, "y1": 1, "layer": "below",
                        "fillcolor": rgba(color, 0.08), "line": {"width": 0}})
    for at, _text in state.reconfigures:
        for key in panels:
            suffix = L.AXIS[key]
            if key == "timeline":
                if at not in view.boundaries:
                    continue
                x = view.boundaries[at]
            else:
                x = at
            out.append({"type": "line", "xref": f"x{suffix}", "yref": f"y{suffix} domain",
                        "x0": x, "x1": x, "y0": 0, "y1": 1, "line": line})
    return out


def _same(trace: Any, props: dict[str, Any]) -> bool:
    """True when the trace already shows these x/y (and customdata) arrays (NaN-aware)."""
    for prop in ("x", "y", "customdata"):
        if prop not in props:
            continue
        old = getattr(trace, prop)
        if old is None or not np.array_equal(np.asarray(old, dtype=float),
                                             np.asarray(props[prop], dtype=float), equal_nan=True):
            return False
    return "text" not in props or list(getattr(trace, "text", None) or ()) == list(props["text"])
