"""The dashboard's one plotly figure: a fixed set of traces, written from `DashboardState`.

Layout (paper Fig. 5-style timeline on top, the per-iteration health below):

    row 1  timeline: one line trace per lane (NaN-separated segments) + rollback markers
    row 2  link GB/s each way            | overlap and device-idle fractions
    row 3  host / device memory (GB)     | loss

With several data-parallel ranks the lane traces stay five (one colour per lane) and each span
sits on its rank's row: the timeline's y axis then reads "r0 device compute", ..., "r1 D2H
(grads out)", ... (DashboardState.lane_labels).

Traces are created once, in a fixed order (`TRACE`), so an update is a `batch_update` that
assigns numpy arrays to existing traces: one message to the browser per refresh.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from superoffload.telemetry.events import LANES
from superoffload.widgets.series import LANE_LABELS, DashboardState, rollback_markers

LANE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")

TRACE: dict[str, int] = {f"lane:{lane}": k for k, lane in enumerate(LANES)}
TRACE.update(
    {
        "rollback": len(LANES),
        "d2h_gbps": len(LANES) + 1,
        "h2d_gbps": len(LANES) + 2,
        "overlap_frac": len(LANES) + 3,
        "device_idle_frac": len(LANES) + 4,
        "host_mem_gb": len(LANES) + 5,
        "device_mem_gb": len(LANES) + 6,
        "loss": len(LANES) + 7,
    }
)
"""Index of each trace in `figure.data`."""


def build_figure(*, live: bool, title: str = "superoffload") -> Any:
    """A FigureWidget when `live` (needs ipywidgets + anywidget), else a plain go.Figure."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{"colspan": 2}, None], [{}, {}], [{}, {}]],
        row_heights=[0.44, 0.28, 0.28],
        vertical_spacing=0.09,
        horizontal_spacing=0.08,
        subplot_titles=(
            "timeline (last iterations; x: seconds)",
            "link GB/s each way (x: iteration)",
            "overlap / device idle (x: iteration)",
            "memory GB (x: seconds)",
            "loss (x: iteration)",
        ),
    )
    for k, lane in enumerate(LANES):
        fig.add_trace(
            # a tick at each end keeps sub-pixel spans (tiny H2D copies) visible
            go.Scatter(
                x=[], y=[], mode="lines+markers", name=LANE_LABELS[lane],
                line={"width": 14, "color": LANE_COLORS[k]}, hoverinfo="text", text=[],
                marker={"symbol": "line-ns-open", "size": 14, "color": LANE_COLORS[k],
                        "line": {"width": 2, "color": LANE_COLORS[k]}},
            ),
            row=1, col=1,
        )
    fig.add_trace(
        go.Scatter(
            x=[], y=[], mode="markers", name="rollback / replay",
            marker={"symbol": "x-thin-open", "size": 16, "color": "#d62728", "line": {"width": 3}},
            hoverinfo="text", text=[],
        ),
        row=1, col=1,
    )
    line_traces = (
        ("D2H GB/s (bytes / iteration time)", "#ff7f0e", 2, 1),
        ("H2D GB/s (bytes / iteration time)", "#9467bd", 2, 1),
        ("overlap (CPU work hidden under compute)", "#2ca02c", 2, 2),
        ("device idle", "#7f7f7f", 2, 2),
        ("host memory GB", "#17becf", 3, 1),
        ("device memory GB", "#bcbd22", 3, 1),
        ("loss", "#e377c2", 3, 2),
    )
    for name, color, row, col in line_traces:
        # H2D dotted: with fp32 both ways it lies exactly on D2H
        dash = "dot" if name.startswith("H2D") else "solid"
        fig.add_trace(
            # lines only: hundreds of SVG markers redrawn at 5 Hz choke a software-rendered page
            go.Scatter(x=[], y=[], mode="lines", name=name,
                       line={"color": color, "width": 2, "dash": dash}),
            row=row, col=col,
        )
    fig.update_yaxes(
        row=1, col=1, tickvals=list(range(len(LANES))), ticktext=[LANE_LABELS[x] for x in LANES],
        range=[len(LANES) - 0.5, -0.5], zeroline=False,  # reversed: compute on top
    )
    fig.update_yaxes(row=2, col=2, range=[0, 1.05])
    fig.update_layout(
        title={"text": title}, height=760, width=1050,
        margin={"l": 60, "r": 20, "t": 70, "b": 40}, uirevision="superoffload",
    )
    return go.FigureWidget(fig) if live else fig


def write_state(fig: Any, state: DashboardState, title: str) -> None:
    """Copy the state's arrays into the figure's traces in one batch."""
    segments = state.lane_segments()
    ranks = state.ranks()
    rb_x, rb_y, rb_text = rollback_markers(state.timeline_spans(), ranks)
    series = state.series()
    loss_it, loss_v = state.loss_series()
    mem_t = np.asarray(state.memory_t_s, dtype=float)
    updates: dict[str, dict[str, Any]] = {}
    for lane, seg in zip(LANES, segments):
        updates[f"lane:{lane}"] = {"x": seg.x_s, "y": seg.y, "text": seg.text}
    updates["rollback"] = {"x": rb_x, "y": rb_y, "text": rb_text}
    for key in ("d2h_gbps", "h2d_gbps"):
        busy = [f"{v:.2f} GB/s while moving" for v in series[key + "_busy"]]
        updates[key] = {"x": series["iteration"], "y": series[key], "text": busy}
    for key in ("overlap_frac", "device_idle_frac"):
        updates[key] = {"x": series["iteration"], "y": series[key]}
    updates["host_mem_gb"] = {"x": mem_t, "y": np.asarray(state.host_mem_gb, dtype=float)}
    updates["device_mem_gb"] = {"x": mem_t, "y": np.asarray(state.device_mem_gb, dtype=float)}
    updates["loss"] = {"x": loss_it, "y": loss_v}
    batch = fig.batch_update() if hasattr(fig, "batch_update") else contextlib.nullcontext()
    with batch:
        for key, props in updates.items():
            trace = fig.data[TRACE[key]]
            if _same(trace, props):
                continue  # nothing new: send nothing to the browser
            for prop, value in props.items():
                setattr(trace, prop, value)
        if fig.layout.title.text != title:
            fig.layout.title.text = title
        labels = state.lane_labels()
        axis = fig.layout.yaxis  # row 1: the timeline
        if list(axis.ticktext or ()) != labels:
            axis.tickvals = list(range(len(labels)))
            axis.ticktext = labels
            axis.range = [len(labels) - 0.5, -0.5]


def _same(trace: Any, props: dict[str, Any]) -> bool:
    """True when the trace already shows these x/y arrays (NaN-aware)."""
    for prop in ("x", "y"):
        old = getattr(trace, prop)
        new = np.asarray(props[prop], dtype=float)
        if old is None or len(old) != len(new):
            return False
        if not np.array_equal(np.asarray(old, dtype=float), new, equal_nan=True):
            return False
    return True

