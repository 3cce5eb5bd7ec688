"""The measured dashboard's plotly figure: a fixed set of traces, written from pure state.

Panels and their places come from `layout` (timeline on top, per-iteration panels below on
one shared x axis of iterations); the arrays from `series`, `timeline` and `panels`. Traces
are created once, in a fixed order (`TRACE`), each bound to its panel's axes for good, so a
refresh assigns arrays to existing traces (`write_state` says whether anything changed) and,
when a panel gains its first data, moves the axes' domains (no panel is drawn before it has
data). Width follows the output area (autosize + responsive); every panel has its own
one-line legend above it and axis titles with units; per-iteration lines carry a hover
template instead of per-point text, so a refresh sends numbers only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.telemetry.events import LANES
from superoffload.widgets import layout as L
from superoffload.widgets.panels import Expected, Workload, measured_arrays, robust_top
from superoffload.widgets.series import DashboardState
from superoffload.widgets.timeline import TimelineView, timeline_view, vlines

PLOT_CONFIG: dict[str, Any] = {"responsive": True, "displaylogo": False}
FONT = {"family": "Arial, Helvetica, sans-serif", "size": 12}


@dataclass(frozen=True, slots=True)
class TraceSpec:
    key: str
    panel: str
    name: str
    kind: str  # "span", "line", "dash", "marker", "vline", "text"
    color: str
    symbol: str = ""
    legend: bool = True


def _specs() -> list[TraceSpec]:
    lane_names = ("compute", "D2H", "CPU opt.", "H2D", "device opt.")
    ev, mc = L.EVENT_COLORS, L.METRIC_COLORS
    out = [TraceSpec(f"lane:{lane}", "timeline", name, "span", L.LANE_COLORS[lane], legend=False)
           for lane, name in zip(LANES, lane_names)]
    out += [
        TraceSpec("boundary", "timeline", "iteration start", "vline", L.REFERENCE_COLOR, legend=False),
        TraceSpec("boundary_text", "timeline", "iteration", "text", "#555555", legend=False),
        TraceSpec("rollback", "timeline", "rollback", "marker", ev["rollback"], "x-thin-open"),
        TraceSpec("replay", "timeline", "replay", "marker", ev["replay"], "diamond-open"),
        TraceSpec("skipped", "timeline", "skipped step", "marker", ev["skipped"], "square"),
        TraceSpec("iteration_ms", "speed", "measured", "line", mc["iteration_ms"]),
        TraceSpec("predicted_ms", "speed", "predicted", "dash", mc["predicted"]),
        TraceSpec("speed_rollback", "speed", "rollback", "marker", ev["rollback"], "x-thin-open", False),
        TraceSpec("speed_replay", "speed", "replay", "marker", ev["replay"], "diamond-open", False),
        TraceSpec("speed_skipped", "speed", "skipped step", "marker", ev["skipped"], "square", False),
        TraceSpec("d2h_gbps", "link", "D2H", "line", mc["d2h"]),
        TraceSpec("h2d_gbps", "link", "H2D", "dash", mc["h2d"]),
        TraceSpec("link_peak", "link", "peak", "dash", L.REFERENCE_COLOR),
        TraceSpec("overlap_pct", "percent", "CPU hidden", "line", mc["overlap"]),
        TraceSpec("idle_pct", "percent", "idle", "line", mc["idle"]),
        TraceSpec("d2h_util_pct", "percent", "D2H use", "line", mc["d2h_util"]),
        TraceSpec("h2d_util_pct", "percent", "H2D use", "dash", mc["h2d_util"]),
        TraceSpec("loss", "loss", "loss", "line", mc["loss"]),
        TraceSpec("host_mem_gb", "memory", "host", "line", mc["host_mem"]),
        TraceSpec("device_mem_gb", "memory", "device", "line", mc["device_mem"]),
    ]
    return out


SPECS = _specs()
TRACE: dict[str, int] = {s.key: k for k, s in enumerate(SPECS)}
"""Index of each trace in `figure.data`."""


def _legend_name(panel: str) -> str:
    suffix = L.AXIS[panel]
    return f"legend{suffix}" if suffix else "legend"


def _trace(go: Any, spec: TraceSpec) -> Any:
    suffix = L.AXIS[spec.panel]
    common = {"x": [], "y": [], "name": spec.name, "xaxis": f"x{suffix}", "yaxis": f"y{suffix}",
              "legend": _legend_name(spec.panel), "showlegend": spec.legend}
    if spec.kind == "span":
        # lines+markers: a tick at each end keeps sub-pixel spans (tiny copies) visible
        return go.Scatter(mode="lines+markers", hoverinfo="text", text=[],
                          line={"width": 12, "color": spec.color},
                          marker={"symbol": "line-ns-open", "size": 12, "color": spec.color,
                                  "line": {"width": 2, "color": spec.color}}, **common)
    if spec.kind == "vline":
        return go.Scatter(mode="lines", hoverinfo="skip",
                          line={"width": 1, "color": spec.color, "dash": "dot"}, **common)
    if spec.kind == "text":
        return go.Scatter(mode="text", text=[], hoverinfo="skip", textposition="middle right",
                          textfont={"size": 10, "color": spec.color}, **common)
    if spec.kind == "marker":
        return go.Scatter(mode="markers", hoverinfo="text", text=[],
                          marker={"symbol": spec.symbol, "size": 11, "color": spec.color,
                                  "line": {"width": 2, "color": spec.color}}, **common)
    # lines only (hundreds of SVG markers redrawn a few times a second choke a slow page), and
    # a hover template instead of per-point text: a refresh re-sends only the numbers
    unit = UNITS.get(spec.panel, "")
    return go.Scatter(mode="lines", connectgaps=False,
                      hovertemplate=f"it %{{x}}: %{{y:.3g}} {unit}<extra>{spec.name}</extra>",
                      line={"color": spec.color, "width": 2,
                            "dash": "dash" if spec.kind == "dash" else "solid"}, **common)


UNITS = {"speed": "ms", "link": "GB/s", "percent": "%", "loss": "", "memory": "GB"}


def build_figure(*, title: str = "superoffload") -> Any:
    """The measured layout's go.Figure, every trace in place and empty (a live view sends it
    to the browser with `liveplot.LivePlot`)."""
    import plotly.graph_objects as go

    fig = go.Figure(data=[_trace(go, s) for s in SPECS])
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 14}},
        autosize=True, height=L.TIMELINE_PX + 200, font=FONT, hovermode="closest",
        margin={"l": 64, "r": 16, "t": L.TOP_PX, "b": 36}, uirevision="superoffload",
        plot_bgcolor="#FAFAFA",
    )
    _apply_grid(fig, L.measured_panels(frozenset()))
    return fig


def _apply_grid(fig: Any, panels: list[str]) -> None:
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
            fig.layout[_legend_name(key)] = {"visible": False}
            continue
        xprops: dict[str, Any] = {"visible": True, "domain": list(dom.x), "anchor": f"y{suffix}",
                                  "showgrid": True, "zeroline": False}
        yprops: dict[str, Any] = {"visible": True, "domain": list(dom.y), "anchor": f"x{suffix}",
                                  "title": {"text": panel.y_title}, "automargin": True}
        if key != "timeline":
            xprops["title"] = {"text": "iteration" if key in grid.bottom_row else ""}
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
        fig.layout[_legend_name(key)] = {
            "visible": True, "orientation": "h", "x": dom.x[0], "xanchor": "left",
            "y": dom.y[1] + 4 * px, "yanchor": "bottom", "font": {"size": 11},
            "bgcolor": "rgba(0,0,0,0)", "itemclick": "toggle", "tracegroupgap": 0}


def panel_annotations(panels: list[str], titles: dict[str, str], marks: list[tuple[int, str]]
                ) -> list[dict[str, Any]]:
    """Panel titles above each panel, and a label per reconfiguration (the newest three) at
    the top of the iteration-time panel, beside its dashed line."""
    grid = L.grid(panels)
    px = 1.0 / grid.height_px
    out: list[dict[str, Any]] = []
    for key in panels:
        dom = grid.domains[key]
        out.append({"text": f"<b>{titles.get(key, L.MEASURED[key].title)}</b>", "showarrow": False,
                    "xref": "paper", "yref": "paper", "x": dom.x[0], "y": dom.y[1] + 28 * px,
                    "xanchor": "left", "yanchor": "bottom", "font": {"size": 12}})
    if "speed" in panels:
        for at, text in marks[-3:]:
            out.append({"text": short_change(text), "showarrow": False, "xref": "x2",
                        "yref": "y2 domain", "x": at, "y": 1.0, "xanchor": "left", "yanchor": "top",
                        "font": {"size": 10, "color": L.EVENT_COLORS["reconfigure"]},
                        "bgcolor": "rgba(255,255,255,0.8)"})
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
    updates = _trace_updates(view, state, arrays, work)
    changed = False
    batch = fig.batch_update() if hasattr(fig, "batch_update") else contextlib.nullcontext()
    with batch:
        shown = [k for k, s in L.AXIS.items() if fig.layout[f"xaxis{s}"].visible]
        if shown != panels:
            _apply_grid(fig, panels)
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
        notes = panel_annotations(panels, titles, state.reconfigures)
        if [a.to_plotly_json() for a in fig.layout.annotations] != notes:
            fig.layout.annotations = notes
            changed = True
        top = robust_top(arrays["wall_ms"], also=arrays["predicted_ms"])
        old = fig.layout.yaxis2.range
        if top is not None and (old is None or abs(old[1] - top) > 0.1 * top):
            fig.layout.yaxis2.range = [0, top]  # a step only when it moves by > 10 %
            changed = True
        shapes = reconfigure_shapes(state, view, panels)
        if [dict(s.to_plotly_json()) for s in fig.layout.shapes] != shapes:
            fig.layout.shapes = shapes
            changed = True
    return changed


def _trace_updates(view: TimelineView, state: DashboardState, a: dict[str, np.ndarray],
                   work: Workload) -> dict[str, dict[str, Any]]:
    up: dict[str, dict[str, Any]] = {}
    for lane, seg in zip(LANES, view.lanes):
        up[f"lane:{lane}"] = {"x": seg.x_ms, "y": seg.y, "text": seg.text}
    bx, by = vlines(list(view.boundaries.values()), -0.7, view.rows - 0.5)
    up["boundary"] = {"x": bx, "y": by}
    up["boundary_text"] = {"x": np.array(list(view.boundaries.values()), dtype=float),
                           "y": np.full(len(view.boundaries), -0.45),
                           "text": [f"it {i}" for i in view.boundaries]}
    for key, m in (("rollback", view.rollbacks), ("replay", view.replays), ("skipped", view.skipped)):
        up[key] = {"x": m.x_ms, "y": m.y, "text": m.text}
    it = a["iteration"]
    up["iteration_ms"] = {"x": it, "y": a["wall_ms"]}
    up["predicted_ms"] = {"x": it, "y": a["predicted_ms"]}
    for key, col, label in (("speed_rollback", "rollbacks", "bucket rollbacks"),
                            ("speed_replay", "replays", "replays")):
        sel = a[col] > 0
        up[key] = {"x": it[sel], "y": a["wall_ms"][sel],
                   "text": [f"it {int(i)}: {int(n)} {label}" for i, n in zip(it[sel], a[col][sel])]}
    skipped = np.isin(it, sorted(state.skipped))
    up["speed_skipped"] = {"x": it[skipped], "y": a["wall_ms"][skipped],
                           "text": [f"it {int(i)}: step skipped" for i in it[skipped]]}
    for key, col in (("d2h_gbps", "d2h_gbps_busy"), ("h2d_gbps", "h2d_gbps_busy")):
        up[key] = {"x": it, "y": a[col]}
    peaks = sorted({p for p in (work.d2h_peak_gbps, work.h2d_peak_gbps) if p})
    if len(it) and peaks:
        up["link_peak"] = {"x": np.concatenate([[it[0], it[-1], np.nan] for _ in peaks]),
                           "y": np.concatenate([[p, p, np.nan] for p in peaks])}
    else:
        up["link_peak"] = {"x": np.array([]), "y": np.array([])}
    for key in ("overlap_pct", "idle_pct", "d2h_util_pct", "h2d_util_pct"):
        up[key] = {"x": it, "y": a[key]}
    li, lv = state.loss_series()
    up["loss"] = {"x": li, "y": lv}
    mi, host, device = state.memory_series()
    up["host_mem_gb"] = {"x": mi, "y": host}
    has_device = state.has_device_memory()
    up["device_mem_gb"] = {"x": mi if has_device else np.array([]),
                           "y": device if has_device else np.array([])}
    return up


def reconfigure_shapes(state: DashboardState, view: TimelineView, panels: list[str]) -> list[dict[str, Any]]:
    """A dashed vertical line at each reconfiguration: on every per-iteration panel at its
    iteration, and on the timeline at the iteration's start when it is in the window."""
    color = L.EVENT_COLORS["reconfigure"]
    line = {"color": color, "width": 1.5, "dash": "dash"}
    out: list[dict[str, Any]] = []
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
    """True when the trace already shows these x/y arrays (NaN-aware)."""
    for prop in ("x", "y"):
        old = getattr(trace, prop)
        new = np.asarray(props[prop], dtype=float)
        if old is None or len(old) != len(new):
            return False
        if not np.array_equal(np.asarray(old, dtype=float), new, equal_nan=True):
            return False
    return "text" not in props or list(getattr(trace, "text", None) or ()) == list(props["text"])
