"""The measured dashboard's plotly figure: a fixed set of traces, written from pure state.

Panels and their places come from `layout` (the timeline on top, per-iteration panels below
in three columns on one shared x axis: iterations or wall-clock seconds), the traces from
`traces`, their arrays from `plotdata`, titles and event marks from `marks`. Traces are
created once, in a fixed order (`TRACE`), each bound to its panel's axes for good, so a
refresh assigns arrays to existing traces (`write_state` says whether anything changed) and,
when a panel gains its first data or is hidden or shown, moves the axes' domains (no panel
is drawn before it has data; until the first complete iteration the timeline says it is
waiting). Width follows the output area (autosize + responsive); one legend for the whole
figure above the timeline (a series has one colour and one entry); axis titles carry units.
The figure is sized to fit one screen at 1366x768 with the status line and the controls
(`layout.MEASURED_SIZES`). The same figure is the HTML report's (`widgets/report.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from superoffload.widgets import layout as L
from superoffload.widgets.compare import Overlay
from superoffload.widgets.marks import panel_annotations, reconfigure_shapes
from superoffload.widgets.panels import Expected, Workload, measured_arrays, robust_top
from superoffload.widgets.plotdata import log_decades, same, trace_updates, x_axis
from superoffload.widgets.series import DashboardState
from superoffload.widgets.timeline import timeline_view
from superoffload.widgets.traces import SPECS, TRACE, make_trace
from superoffload.widgets.view import ViewOptions

__all__ = ["FONT", "PLOT_CONFIG", "build_figure", "legend_px", "write_state"]

PLOT_CONFIG: dict[str, Any] = {"responsive": True, "displaylogo": False}
FONT = {"family": "Arial, Helvetica, sans-serif", "size": 11}
LEGEND_WIDTH_PX = 1000
"""The plot width the legend's lines are reserved for (a 1366 px window with JupyterLab's
file browser open gives ~1000 px; wider, the legend takes fewer lines than reserved)."""


def legend_px(overlays: int = 0) -> int:
    """The band above the timeline the figure-wide legend needs (its lines at
    `LEGEND_WIDTH_PX`, with `overlays` compared runs listed too)."""
    names = [s.name for s in SPECS if s.legend and not s.key.startswith("run")]
    names += [f"run {k + 1} (a compared run)" for k in range(overlays)]
    return L.LEGEND_LINE_PX * L.legend_lines(names, LEGEND_WIDTH_PX) + 4


def build_figure(*, title: str = "superoffload") -> Any:
    """The measured layout's go.Figure, every trace in place and empty (a live view sends it
    to the browser with `liveplot.LivePlot`)."""
    import plotly.graph_objects as go

    fig = go.Figure(data=[make_trace(go, s) for s in SPECS])
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "top",
               "yref": "container", "pad": {"t": 4}, "font": {"size": 13}},
        autosize=True, font=FONT, hovermode="closest",
        margin={"l": 56, "r": 12, "t": L.MEASURED_SIZES.top_px, "b": 30},
        uirevision="superoffload", plot_bgcolor="#FAFAFA",
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "bottom",
                "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)", "itemclick": "toggle",
                "tracegroupgap": 0, "entrywidthmode": "pixels"},
    )
    _apply_grid(fig, L.measured_panels(frozenset()), "iteration", 0)
    return fig


def measured_grid(panels: Sequence[str], overlays: int = 0, *, titled: bool = True) -> L.Grid:
    """The measured layout's grid; `titled=False`: no band for the figure's title (the live
    view's status line says it)."""
    sizes = L.MEASURED_SIZES if titled else dataclasses.replace(L.MEASURED_SIZES, top_px=4)
    return L.grid(panels, sizes=sizes, legend_px=legend_px(overlays))


def _apply_grid(fig: Any, panels: list[str], x_title: str, overlays: int, titled: bool = True) -> None:
    """Place the axes of `panels`; hide the others (titles: `marks.panel_annotations`)."""
    grid = measured_grid(panels, overlays, titled=titled)
    fig.layout.height = grid.height_px
    fig.layout.margin.t = L.MEASURED_SIZES.top_px if titled else 4
    top = max((d.y[1] for d in grid.domains.values()), default=1.0)
    fig.layout.legend.y = top + (L.MEASURED_SIZES.header_px + 2) / grid.height_px
    for key, suffix in L.AXIS.items():
        xa, ya = f"xaxis{suffix}", f"yaxis{suffix}"
        dom = grid.domains.get(key)
        panel = L.MEASURED[key]
        if dom is None:
            fig.layout[xa] = {"visible": False, "domain": [0, 0.01]}
            fig.layout[ya] = {"visible": False, "domain": [0, 0.01]}
            continue
        xprops: dict[str, Any] = {"visible": True, "domain": list(dom.x), "anchor": f"y{suffix}",
                                  "showgrid": True, "zeroline": False, "automargin": True,
                                  "title": {"text": "", "font": {"size": 11}}}
        yprops: dict[str, Any] = {"visible": True, "domain": list(dom.y), "anchor": f"x{suffix}",
                                  "title": {"text": panel.y_title, "standoff": 4},
                                  "automargin": True, "nticks": 5}
        if key != "timeline":
            xprops["title"]["text"] = x_title if key in grid.bottom_row else ""
            xprops["nticks"] = 6
            if key != "speed":
                xprops["matches"] = "x2"  # one x axis for every panel below
            yprops["rangemode"] = "tozero"
            yprops["separatethousands"] = True
            yprops["exponentformat"] = "none"
        if key == "percent":
            yprops["range"] = [0, 105]
        if key == "link":  # rates far below the reference (a CPU "link") stay readable beside it
            yprops["type"] = "log"
            yprops["dtick"] = 1  # a label per power of ten
            yprops.pop("rangemode")
            yprops.pop("exponentformat")
        fig.layout[xa] = xprops
        fig.layout[ya] = yprops


def write_state(fig: Any, state: DashboardState, title: str, *, work: Workload | None = None,
                expected: Sequence[Expected] = (), view: ViewOptions | None = None,
                overlays: Sequence[Overlay] = ()) -> bool:
    """Copy the state's arrays into the figure's traces and layout (in one batch on a
    FigureWidget), as `view` says (hidden panels, smoothing, x axis) with `overlays` (compared
    runs) in their slots; an empty `title` leaves no room for one; True when anything changed."""
    work = work or Workload()
    view = view or ViewOptions()
    timeline = timeline_view(state.timeline_spans(), skipped=state.skipped,
                             reconfigures=state.reconfigures)
    arrays = measured_arrays(state, work, expected)
    panels = L.measured_panels(state.available() | ({"speed", "percent", "link", "loss"}
                                                    if overlays else set()), view.hidden)
    top = robust_top(arrays["iteration_ms"], also=arrays["predicted_ms"])
    updates = trace_updates(timeline, state, arrays, work, top, view, overlays)
    xs = x_axis(state, arrays, view)
    x_title = view.x_title(state.stride(), bool(overlays))
    changed = False
    batch = fig.batch_update() if hasattr(fig, "batch_update") else contextlib.nullcontext()
    with batch:
        grid = measured_grid(panels, len(overlays), titled=bool(title))
        shown = [k for k, s in L.AXIS.items() if fig.layout[f"xaxis{s}"].visible]
        bottom = [fig.layout[f"xaxis{L.AXIS[k]}"].title.text for k in shown if k != "timeline"]
        if shown != panels or (bottom and x_title not in bottom) or fig.layout.height != grid.height_px:
            _apply_grid(fig, panels, x_title, len(overlays), titled=bool(title))
            changed = True
        for key, props in updates.items():
            trace = fig.data[TRACE[key]]
            if same(trace, props):
                continue  # nothing new: send nothing to the browser
            changed = True
            for prop, value in props.items():
                setattr(trace, prop, value)
        if fig.layout.title.text != title:
            fig.layout.title.text = title
            changed = True
        axis = fig.layout.yaxis
        if list(axis.ticktext or ()) != timeline.labels:
            changed = True
            axis.tickvals = list(range(timeline.rows))
            axis.ticktext = timeline.labels
            axis.range = [timeline.rows - 0.5, -1.0]  # reversed: compute on top; room for "it N"
            axis.zeroline = False
        first = min(timeline.boundaries, default=None)
        titles = {"timeline": f"timeline · ms since iteration {first} started" if first is not None
                  else "timeline · waiting for the first iteration"}
        notes = panel_annotations(grid, panels, titles, state.reconfigures, x_of=xs.at,
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
        shapes = reconfigure_shapes(state, timeline, panels, x_of=xs.at)
        if [dict(s.to_plotly_json()) for s in fig.layout.shapes] != shapes:
            fig.layout.shapes = shapes
            changed = True
    return changed
