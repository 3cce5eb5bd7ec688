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
The figure is a plain dict (`widgets/shared/plotjson.py`): a refresh builds no plotly object. The
figure is sized to fit one screen at 1366x768 with the status line and the controls
(`layout.MEASURED_SIZES`). The same figure is the HTML report's (`widgets/dashboard/report.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.compare import Overlay
from superoffload.widgets.dashboard.expected import Expected
from superoffload.widgets.dashboard.marks import panel_annotations, reconfigure_shapes
from superoffload.widgets.dashboard.options import ViewOptions
from superoffload.widgets.dashboard.plotdata import log_decades, same, trace_updates, x_axis
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import Workload, measured_arrays, robust_top
from superoffload.widgets.dashboard.timeline import timeline_view
from superoffload.widgets.dashboard.traces import SPECS, TRACE, make_trace

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


def build_figure(*, title: str = "superoffload") -> dict[str, Any]:
    """The measured layout's figure dict (`widgets/shared/plotjson.py`), every trace in place and
    empty (a live view sends it to the browser with the LivePlot widget,
    `widgets/shared/liveplot.live_plot_class`)."""
    fig: dict[str, Any] = {"data": [make_trace(s) for s in SPECS], "layout": {
        "title": {"text": title, "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "top",
                  "yref": "container", "pad": {"t": 4}, "font": {"size": 13}},
        "autosize": True, "font": dict(FONT), "hovermode": "closest",
        "margin": {"l": 56, "r": 12, "t": L.MEASURED_SIZES.top_px, "b": 30},
        "uirevision": "superoffload", "plot_bgcolor": "#FAFAFA",
        "legend": {"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0,
                   "yanchor": "bottom", "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)",
                   "itemclick": "toggle", "tracegroupgap": 0, "entrywidthmode": "pixels"},
        "annotations": [], "shapes": [],
    }}
    _apply_grid(fig, L.measured_panels(frozenset()), "iteration", 0)
    return fig


def measured_grid(panels: Sequence[str], overlays: int = 0, *, titled: bool = True) -> L.Grid:
    """The measured layout's grid; `titled=False`: no band for the figure's title (the live
    view's status line says it)."""
    sizes = L.MEASURED_SIZES if titled else dataclasses.replace(L.MEASURED_SIZES, top_px=4)
    return L.grid(panels, sizes=sizes, legend_px=legend_px(overlays))


def _apply_grid(fig: dict[str, Any], panels: list[str], x_title: str, overlays: int,
                titled: bool = True) -> None:
    """Place the axes of `panels`; hide the others (titles: `marks.panel_annotations`)."""
    layout = fig["layout"]
    grid = measured_grid(panels, overlays, titled=titled)
    layout["height"] = grid.height_px
    layout["margin"]["t"] = L.MEASURED_SIZES.top_px if titled else 4
    top = max((d.y[1] for d in grid.domains.values()), default=1.0)
    layout["legend"]["y"] = top + (L.MEASURED_SIZES.header_px + 2) / grid.height_px
    for key, suffix in L.AXIS.items():
        xa, ya = f"xaxis{suffix}", f"yaxis{suffix}"
        dom = grid.domains.get(key)
        panel = L.MEASURED[key]
        if dom is None:
            layout[xa] = {"visible": False, "domain": [0, 0.01]}
            layout[ya] = {"visible": False, "domain": [0, 0.01]}
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
                # one x axis for every panel below
                xprops["matches"] = "x2"
            yprops["rangemode"] = "tozero"
            yprops["separatethousands"] = True
            yprops["exponentformat"] = "none"
        if key == "percent":
            yprops["range"] = [0, 105]
        # rates far below the reference (a CPU "link") stay readable beside it
        if key == "link":
            yprops["type"] = "log"
            # a label per power of ten
            yprops["dtick"] = 1
            yprops.pop("rangemode")
            yprops.pop("exponentformat")
        layout[xa] = xprops
        layout[ya] = yprops


def write_state(fig: dict[str, Any], state: DashboardState, title: str, *,
                work: Workload | None = None, expected: Sequence[Expected] = (),
                view: ViewOptions | None = None, overlays: Sequence[Overlay] = ()) -> bool:
    """Copy the state's arrays into the figure's traces and layout, as `view` says (hidden
    panels, smoothing, x axis) with `overlays` (compared runs) in their slots; an empty
    `title` leaves no room for one; True when anything changed (else nothing is sent)."""
    work = work or Workload()
    view = view or ViewOptions()
    layout = fig["layout"]
    timeline = timeline_view(state.timeline_spans(), skipped=state.skipped,
                             reconfigures=state.reconfigures, lanes=state.lanes_seen)
    arrays = measured_arrays(state, work, expected)
    panels = L.measured_panels(state.available() | ({"speed", "percent", "link", "loss"}
                                                    if overlays else set()), view.hidden)
    top = robust_top(arrays["iteration_ms"], also=arrays["predicted_ms"])
    updates = trace_updates(timeline, state, arrays, work, top, view, overlays)
    xs = x_axis(state, arrays, view)
    x_title = view.x_title(state.stride(), bool(overlays))
    changed = False
    grid = measured_grid(panels, len(overlays), titled=bool(title))
    shown = [k for k, s in L.AXIS.items() if layout.get(f"xaxis{s}", {}).get("visible")]
    bottom = [layout[f"xaxis{L.AXIS[k]}"]["title"]["text"] for k in shown if k != "timeline"]
    if shown != panels or (bottom and x_title not in bottom) or layout["height"] != grid.height_px:
        _apply_grid(fig, panels, x_title, len(overlays), titled=bool(title))
        changed = True
    for key, props in updates.items():
        trace = fig["data"][TRACE[key]]
        if same(trace, props):
            # nothing new: send nothing to the browser
            continue
        changed = True
        trace.update(props)
    if layout["title"]["text"] != title:
        layout["title"]["text"] = title
        changed = True
    axis = layout["yaxis"]
    if list(axis.get("ticktext") or ()) != timeline.labels:
        changed = True
        axis["tickvals"] = list(range(timeline.rows))
        axis["ticktext"] = timeline.labels
        # reversed: compute on top; room for "it N"
        axis["range"] = [timeline.rows - 0.5, -1.0]
        axis["zeroline"] = False
    first = min(timeline.boundaries, default=None)
    titles = {"timeline": f"timeline · ms since iteration {first} started" if first is not None
              else "timeline · waiting for the first iteration",
              "link": f"{L.MEASURED['link'].title} · {work.link_name}" if work.link_name
              else L.MEASURED["link"].title}
    notes = panel_annotations(grid, panels, titles, state.reconfigures, x_of=xs.at,
                              waiting=state.plotted_rank is None, trials=state.ab_trials)
    if layout.get("annotations") != notes:
        layout["annotations"] = notes
        changed = True
    old = layout["yaxis2"].get("range")
    if top is not None and (old is None or abs(old[1] - top) > 0.1 * top):
        # a step only when it moves by > 10 %
        layout["yaxis2"]["range"] = [0, top]
        changed = True
    decades = log_decades([arrays[k] for k in ("d2h_gbps_busy_min", "d2h_gbps_busy_max",
                                               "h2d_gbps_busy_min", "h2d_gbps_busy_max")],
                          also=(work.d2h_peak_gbps, work.h2d_peak_gbps))
    if decades is not None and list(layout["yaxis3"].get("range") or ()) != decades:
        layout["yaxis3"]["range"] = decades
        changed = True
    shapes = reconfigure_shapes(state, timeline, panels, x_of=xs.at)
    if layout.get("shapes") != shapes:
        layout["shapes"] = shapes
        changed = True
    return changed
