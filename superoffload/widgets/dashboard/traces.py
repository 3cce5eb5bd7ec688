"""The measured figure's traces: one fixed table, each trace bound to its panel for good.

A per-iteration line names its `telemetry.vocabulary` metric: its hover text says the
metric's label and unit, and its panel's y axis carries that unit (one vocabulary for every
view). Lines of a long run are drawn per bin of the history (`telemetry.binned.Binned`): the bin's
pooled value as the line (optionally smoothed: `smoothing.ema`), the minimum..maximum of
each bin as a light band behind it, so one slow iteration or one loss spike stays visible
however many iterations share a bin. Compared runs get fixed slots of their own (`run{k}:`),
empty until a run is loaded; one legend lists every series once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.telemetry.events import LANE_LABELS, LANES
from superoffload.telemetry.vocabulary import METRICS
from superoffload.widgets.dashboard import layout as L


@dataclass(frozen=True, slots=True)
class TraceSpec:
    key: str
    panel: str
    name: str
    """Legend entry (short: the panel title and the hover text carry the rest)."""
    kind: str
    """"span", "line", "dash", "band", "peak", "marker", "vline", "text", "run" (a compared
    run's line: `symbol` holds its dash)."""
    color: str
    symbol: str = ""
    legend: bool = True
    metric: str = ""
    """The vocabulary metric a line or band draws ("" for timeline shapes and markers)."""
    group: str = ""
    """Legend group: clicking the entry hides every trace of the group (a line and its band,
    an event's markers on the timeline and on the iteration-time panel)."""


OVERLAY_METRICS: tuple[tuple[str, str], ...] = (
    ("iteration_ms", "speed"), ("d2h_gbps_busy", "link"), ("h2d_gbps_busy", "link"),
    ("cpu_step_hidden_pct", "percent"), ("device_idle_pct", "percent"), ("loss", "loss"))
"""(metric, panel) of the lines a compared run adds: in the metric's colour, in the run's
line style (`layout.RUN_DASHES`)."""
MAX_OVERLAYS = len(L.RUN_DASHES)
"""Runs that can be compared at once beside the live one (a trace slot each, fixed)."""


def _specs() -> list[TraceSpec]:
    ev, mc = L.EVENT_COLORS, L.METRIC_COLORS
    # one trace per lane the engine can record (empty while a run has no spans there)
    out = [TraceSpec(f"lane:{lane}", "timeline", LANE_LABELS[lane], "span", L.LANE_COLORS[lane],
                     legend=False) for lane in LANES]
    out += [
        TraceSpec("boundary", "timeline", "iteration start", "vline", L.REFERENCE_COLOR,
                  legend=False),
        TraceSpec("boundary_text", "timeline", "iteration", "text", "#555555", legend=False),
        # events: listed once in the legend, by their iteration-time markers (same legend
        # group: one click hides both)
        TraceSpec("rollback", "timeline", "rollback", "marker", ev["rollback"], "x-thin-open",
                  legend=False, group="rollback"),
        TraceSpec("replay", "timeline", "replay", "marker", ev["replay"], "diamond-open",
                  legend=False, group="replay"),
        TraceSpec("skipped", "timeline", "skipped step", "marker", ev["skipped"], "square",
                  legend=False, group="skipped"),
    ]
    lines = (
        # (key, panel, legend name, kind, colour, band): one legend for the figure, so a
        # name says what the line is without its panel (D2H is D2H in every panel)
        ("iteration_ms", "speed", "iteration time", "line", mc["iteration_ms"], True),
        ("engine_ms", "speed", "engine time", "line", mc["engine_ms"], False),
        ("d2h_gbps_busy", "link", "D2H", "line", mc["d2h"], True),
        ("h2d_gbps_busy", "link", "H2D", "dash", mc["h2d"], True),
        ("cpu_step_hidden_pct", "percent", "CPU step hidden", "line", mc["overlap"], True),
        ("device_idle_pct", "percent", "device idle", "line", mc["idle"], True),
        ("loss", "loss", "loss", "line", mc["loss"], True),
        ("host_mem_gb", "memory", "host memory", "line", mc["host_mem"], False),
        ("device_mem_gb", "memory", "device memory", "line", mc["device_mem"], False),
    )
    for key, panel, name, kind, color, band in lines:
        # behind its line: drawn first
        if band:
            out.append(TraceSpec(f"{key}:band", panel, name, "band", color, legend=False,
                                 metric=key, group=key))
        out.append(TraceSpec(key, panel, name, kind, color, metric=key, group=key))
    out += [
        TraceSpec("predicted_ms", "speed", "predicted", "dash", mc["predicted"],
                  metric="iteration_ms"),
        TraceSpec("d2h_peak", "link", "planner's D2H", "peak", mc["d2h_peak"],
                  metric="d2h_gbps_busy"),
        TraceSpec("h2d_peak", "link", "planner's H2D", "peak", mc["h2d_peak"],
                  metric="h2d_gbps_busy"),
        TraceSpec("speed_rollback", "speed", "rollback", "marker", ev["rollback"], "x-thin-open",
                  group="rollback"),
        TraceSpec("speed_replay", "speed", "replay", "marker", ev["replay"], "diamond-open",
                  group="replay"),
        TraceSpec("speed_skipped", "speed", "skipped step", "marker", ev["skipped"], "square",
                  group="skipped"),
    ]
    line_color = {key: color for key, _, _, _, color, _ in lines}
    # compared runs: empty until one is loaded
    for k, dash in enumerate(L.RUN_DASHES):
        for j, (metric, panel) in enumerate(OVERLAY_METRICS):
            out.append(TraceSpec(f"run{k}:{metric}", panel, f"run {k + 1}", "run",
                                 line_color[metric], symbol=dash, legend=j == 0, metric=metric,
                                 group=f"run{k}"))
    return out


SPECS = _specs()
TRACE: dict[str, int] = {s.key: k for k, s in enumerate(SPECS)}
"""Index of each trace in `figure.data`."""
EVENT_ROWS = {"rollback": 0.97, "replay": 0.91, "skipped": 0.85}
"""Event markers on the iteration-time panel: a strip at these fractions of its y range
(above the line, never on top of one another)."""


def legend_name(panel: str) -> str:
    """The figure has one legend (a series has one colour and one entry in every panel)."""
    return "legend"


def rgba(color: str, alpha: float) -> str:
    """"#RRGGBB" -> "rgba(r,g,b,alpha)" (a band's fill)."""
    r, g, b = (int(color[k:k + 2], 16) for k in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


_HOVER_FORMAT = {"ms": ",.1f", "%": ".1f", "GB/s": ".3~g", "nats": ".3f", "GB": ".3~g"}
"""d3 formats of hover values by unit: "1,750.0 ms", never "1.75e+3 ms"."""


EMPTY = np.empty(0)
EMPTY_CUSTOM = np.empty((0, 5))


def make_trace(spec: TraceSpec) -> dict[str, Any]:
    """The empty plotly trace of `spec`, as a dict (the figure fills its arrays)."""
    suffix = L.AXIS[spec.panel]
    common: dict[str, Any] = {"type": "scatter", "x": EMPTY, "y": EMPTY, "name": spec.name,
                              "xaxis": f"x{suffix}", "yaxis": f"y{suffix}",
                              "legend": legend_name(spec.panel), "showlegend": spec.legend}
    if spec.group:
        common["legendgroup"] = spec.group
    if spec.kind == "span":
        # lines+markers: a tick at each end keeps sub-pixel spans (tiny copies) visible
        return {**common, "mode": "lines+markers", "hoverinfo": "text", "text": [],
                "line": {"width": 12, "color": spec.color},
                "marker": {"symbol": "line-ns-open", "size": 12, "color": spec.color,
                           "line": {"width": 2, "color": spec.color}}}
    if spec.kind == "vline":
        return {**common, "mode": "lines", "hoverinfo": "skip",
                "line": {"width": 1, "color": spec.color, "dash": "dot"}}
    if spec.kind == "text":
        return {**common, "mode": "text", "text": [], "hoverinfo": "skip",
                "textposition": "middle right",
                "textfont": {"size": 10, "color": spec.color}}
    if spec.kind == "marker":
        return {**common, "mode": "markers", "hoverinfo": "text", "text": [],
                "marker": {"symbol": spec.symbol, "size": 11, "color": spec.color,
                           "line": {"width": 2, "color": spec.color}}}
    if spec.kind == "band":
        return {**common, "mode": "lines", "fill": "toself",
                "fillcolor": rgba(spec.color, 0.18), "line": {"width": 0, "color": spec.color},
                "hoverinfo": "skip"}
    metric = METRICS.get(spec.metric)
    unit = metric.unit if metric is not None else "nats"
    fmt = _HOVER_FORMAT.get(unit, ".3g")
    if spec.kind == "run":
        hover = f"%{{fullData.name}} · it +%{{x}}: %{{y:{fmt}}} {unit}<extra></extra>"
        return {**common, "mode": "lines", "connectgaps": False, "hovertemplate": hover,
                "opacity": 0.8, "line": {"color": spec.color, "width": 1.5, "dash": spec.symbol}}
    assert metric is not None, spec.key
    if spec.kind == "peak":
        return {**common, "mode": "lines",
                "line": {"color": spec.color, "width": 1.5, "dash": "dot"},
                "hovertemplate": f"{spec.name}: %{{y:.3g}} {metric.unit}<extra></extra>"}
    # lines only (hundreds of SVG markers redrawn a few times a second choke a slow page), and
    # a hover template instead of per-point text: a refresh re-sends only the numbers.
    # customdata per bin: first and last iteration, minimum, maximum, the bin's own value
    # (the line is its smoothed value when smoothing is on)
    label = "predicted" if spec.key == "predicted_ms" else metric.label
    hover = (f"it %{{customdata[0]}}-%{{customdata[1]}}: %{{customdata[4]:{fmt}}} {metric.unit}"
             f" (min %{{customdata[2]:{fmt}}}, max %{{customdata[3]:{fmt}}}; line %{{y:{fmt}}})"
             f"<extra>{label}</extra>")
    return {**common, "mode": "lines", "connectgaps": False, "hovertemplate": hover,
            "customdata": EMPTY_CUSTOM,
            "line": {"color": spec.color, "width": 2,
                     "dash": "dash" if spec.kind == "dash" else "solid"}}
