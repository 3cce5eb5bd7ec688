"""The simulated layout: one planner result (`plan.simulate`) as a static plotly figure.

A simulation is one steady-state iteration, so it gets no per-iteration panels (they would
be lines through two points). Instead:

    timeline           the spans touching the steady window, ms since the window starts,
                       iteration boundaries marked
    lanes              busy and exposed ms per lane inside the window; "exposed" = the lane
                       worked while the device computed nothing (it was on the critical path)
    link               GB/s while moving each way (bytes / busy time in the window) against the
                       profile's peak, with the link's use in percent of the window
    memory             needed vs usable capacity on each side (red and "DOES NOT FIT" when not)

The pure part (`sim_figures`) is tested without plotly; `build_sim_figure` draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from superoffload.telemetry import intervals, metrics
from superoffload.telemetry.events import LANE_COMPUTE, LANE_LABELS, Span, lanes_in
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.timeline import spaced_labels, timeline_view, vlines
from superoffload.widgets.shared.profile import rank_share


@dataclass(frozen=True, slots=True)
class LinkFigure:
    gbps_busy: float
    """Bytes moved in the window / the lane's busy time in the window (NaN: no bytes)."""
    busy_pct: float
    """Lane busy time / window length, in percent."""
    peak_gbps: float | None


@dataclass(frozen=True, slots=True)
class MemoryBar:
    side: str
    needed_gb: float
    usable_gb: float | None

    @property
    def fits(self) -> bool:
        return self.usable_gb is None or self.needed_gb <= self.usable_gb


@dataclass(frozen=True, slots=True)
class SimFigures:
    window: tuple[float, float]
    spans: list[Span]
    busy_ms: dict[str, float]
    exposed_ms: dict[str, float]
    link: dict[str, LinkFigure]
    memory: list[MemoryBar]
    problems: list[str]
    title: str


def window_spans(spans: list[Span], window: tuple[float, float]) -> list[Span]:
    w0, w1 = window
    return [s for s in spans if s.end_s > w0 and s.start_s < w1]


def sim_figures(result: Any, profile: Any = None) -> SimFigures:
    """What the simulated layout shows for `result` (a `plan.SimResult`); `profile` gives the
    link peaks and memory capacities (default: the preset named by `result.profile`)."""
    from superoffload.plan.memory import DEVICE_HEADROOM, HOST_HEADROOM

    profile = profile if profile is not None else _preset(getattr(result, "profile", ""))
    # the simulated memory is one rank's: its capacity is that rank's share of the host
    profile = rank_share(profile, getattr(result, "shape", None))
    window = tuple(getattr(result, "window", (0.0, 0.0)))
    if not window[1] > window[0]:
        ends = [s.end_s for s in result.timeline]
        window = (min((s.start_s for s in result.timeline), default=0.0), max(ends, default=0.0))
    w: tuple[float, float] = (float(window[0]), float(window[1]))
    spans = window_spans(list(result.timeline), w)
    device = metrics.device_busy(spans)
    busy, exposed = {}, {}
    # the lanes this schedule uses (no storage row without it)
    for lane in lanes_in(spans):
        own = intervals.clip([(s.start_s, s.end_s) for s in spans if s.lane == lane], w)
        busy[lane] = intervals.length(own) * 1e3
        exposed[lane] = (0.0 if lane == LANE_COMPUTE
                         else intervals.length(intervals.subtract(own, device)) * 1e3)
    length_s = w[1] - w[0]
    link = {}
    for lane in ("d2h", "h2d"):
        moved = 0.0
        for s in spans:
            if s.lane == lane and s.nbytes and s.end_s > s.start_s:
                inside = min(s.end_s, w[1]) - max(s.start_s, w[0])
                # the window's share
                moved += s.nbytes * inside / (s.end_s - s.start_s)
        busy_s = busy.get(lane, 0.0) / 1e3
        peak = getattr(profile, f"{lane}_gbps", None)
        # the rate while moving (bytes over busy time, not over the window): a lane that
        # moved nothing has no rate (NaN), which is not a rate of 0 GB/s
        gbps_busy = math.nan
        if busy_s > 0 and moved:
            gbps_busy = moved / busy_s / 1e9
        busy_pct = 100 * busy_s / length_s if length_s > 0 else math.nan
        link[lane] = LinkFigure(gbps_busy=gbps_busy, busy_pct=busy_pct,
                                peak_gbps=float(peak) if peak else None)
    mem = getattr(result, "memory", {}) or {}
    bars = []
    for side, cap_name, headroom in (("device", "device_memory_bytes", DEVICE_HEADROOM),
                                     ("host", "host_memory_bytes", HOST_HEADROOM)):
        needed = mem.get(side) if isinstance(mem, dict) else getattr(mem, side, None)
        cap = getattr(profile, cap_name, None)
        if isinstance(needed, (int, float)):
            # usable = capacity x the planner's headroom (plan/memory.py), what its fit uses
            usable_gb = float(cap) * headroom / 1e9 if cap else None
            bars.append(MemoryBar(side, float(needed) / 1e9, usable_gb))
    problems = list(getattr(result, "problems", []) or [])
    return SimFigures(window=w, spans=spans, busy_ms=busy, exposed_ms=exposed, link=link,
                      memory=bars, problems=problems, title=sim_title(result))


def sim_title(result: Any) -> str:
    parts = ["simulated"]
    iteration_s = getattr(result, "iteration_s", None)
    if isinstance(iteration_s, (int, float)):
        if iteration_s < 1:
            parts.append(f"{iteration_s * 1e3:.1f} ms/iteration")
        else:
            parts.append(f"{iteration_s:.3f} s/iteration")
    tflops = getattr(result, "tflops", None)
    if isinstance(tflops, (int, float)):
        parts.append(f"{tflops:.3g} TFLOP/s")
    if getattr(result, "profile", None):
        parts.append(f"profile {result.profile}")
    return " · ".join(parts)


def _preset(name: str) -> Any:
    from superoffload import plan

    try:
        return plan.profiles.get(name)
    except ValueError:
        # a what-if profile: no preset to read peaks and capacities from
        return None


def build_sim_figure(figs: SimFigures, *, title: str | None = None) -> Any:
    """A plain plotly Figure of the simulated layout (static: shown as a plotly mime bundle)."""
    import plotly.graph_objects as go

    panels = sim_panels(figs)
    # the memory panel grows with its bars (36 px each) plus its axis and legend
    grid = L.grid(panels, full_width=("timeline", "memory"),
                  heights={"memory": 36 * len(figs.memory) + 40})
    fig = go.Figure()
    view = timeline_view(figs.spans, origin_s=figs.window[0])
    for lane in view.rows_lanes:
        seg = view.lanes[lane]
        fig.add_trace(go.Scatter(x=seg.x_ms, y=seg.y, text=seg.text, hoverinfo="text",
                                 mode="lines+markers", name=LANE_LABELS[lane], showlegend=False,
                                 line={"width": 12, "color": L.LANE_COLORS[lane]},
                                 marker={"symbol": "line-ns-open", "size": 12,
                                         "color": L.LANE_COLORS[lane]}))
    bx, by = vlines(list(view.boundaries.values()), -0.7, view.rows - 0.5)
    fig.add_trace(go.Scatter(x=bx, y=by, mode="lines", hoverinfo="skip", showlegend=False,
                             line={"width": 1, "color": L.REFERENCE_COLOR, "dash": "dot"}))
    starts = spaced_labels(view.boundaries, view.x_range_ms)
    fig.add_trace(go.Scatter(x=list(starts.values()), y=[-0.45] * len(starts),
                             text=[f"it {i}" for i in starts], mode="text",
                             textposition="middle right", hoverinfo="skip", showlegend=False,
                             textfont={"size": 10, "color": "#555555"}))
    labels = [LANE_LABELS[lane] for lane in figs.busy_ms]
    for key, name, values, color in (
            ("busy", "busy", figs.busy_ms, "#4C4C4C"),
            ("exposed", "exposed", figs.exposed_ms, L.EVENT_COLORS["not_fit"])):
        fig.add_trace(go.Bar(y=labels, x=[values[lane] for lane in figs.busy_ms],
                             orientation="h", name=name,
                             marker={"color": color}, xaxis="x2", yaxis="y2", legend="legend2",
                             hovertemplate="%{y}: %{x:.3g} ms " + key + "<extra></extra>"))
    # each bar's numbers are its category label under the axis: a label above the bar would
    # be struck through by the peak line when the rate is near the peak
    categories = {lane: link_category(lane.upper(), figs.link[lane]) for lane in ("d2h", "h2d")}
    for lane in ("d2h", "h2d") if "link" in panels else ():
        f = figs.link[lane]
        fig.add_trace(go.Bar(x=[categories[lane]], y=[f.gbps_busy], name=lane.upper(),
                             marker={"color": L.METRIC_COLORS[lane]}, xaxis="x3", yaxis="y3",
                             legend="legend3", showlegend=False, hoverinfo="text",
                             hovertext=[f"{lane.upper()} while moving {f.gbps_busy:.3g} GB/s, "
                                        f"busy {f.busy_pct:.2g} % of the window"]))
        # each direction's own peak, in its own colour, one legend entry each
        if f.peak_gbps:
            fig.add_trace(go.Scatter(x=[categories[lane]], y=[f.peak_gbps], mode="markers",
                                     name=f"{lane.upper()} peak", xaxis="x3", yaxis="y3",
                                     legend="legend3", hoverinfo="text",
                                     hovertext=f"{lane.upper()} peak {f.peak_gbps:.3g} GB/s",
                                     marker={"symbol": "line-ew-open", "size": 40,
                                             "color": L.METRIC_COLORS[f"{lane}_peak"],
                                             "line": {"width": 3}}))
    sides = [b.side for b in figs.memory]
    fig.add_trace(go.Bar(
        x=[b.needed_gb for b in figs.memory], y=sides, orientation="h", name="needed",
        marker={"color": [L.METRIC_COLORS["host_mem"] if b.fits else L.EVENT_COLORS["not_fit"]
                          for b in figs.memory]},
        text=[f"{b.needed_gb:.3g} GB" + ("" if b.fits else " · DOES NOT FIT") for b in figs.memory],
        textposition="auto", xaxis="x4", yaxis="y4", legend="legend4", hoverinfo="text"))
    caps = [(b.side, b.usable_gb) for b in figs.memory if b.usable_gb is not None]
    fig.add_trace(go.Scatter(x=[c for _, c in caps], y=[s for s, _ in caps], mode="markers",
                             name="usable capacity", xaxis="x4", yaxis="y4", legend="legend4",
                             marker={"symbol": "line-ns-open", "size": 28, "color": "#333333",
                                     "line": {"width": 3}},
                             hovertext=[f"{s}: {c:.3g} GB usable" for s, c in caps],
                             hoverinfo="text"))
    px = 1.0 / grid.height_px
    annotations = []
    titles = {"timeline": "timeline of the steady-state iteration · ms since the window started"}
    for k, (key, panel) in enumerate(L.SIMULATED.items()):
        suffix = "" if k == 0 else str(k + 1)
        dom = grid.domains.get(key)
        if dom is None:
            fig.layout[f"xaxis{suffix}"] = {"visible": False}
            fig.layout[f"yaxis{suffix}"] = {"visible": False}
            continue
        fig.layout[f"xaxis{suffix}"] = {"domain": list(dom.x), "anchor": f"y{suffix}",
                                        "automargin": True}
        fig.layout[f"yaxis{suffix}"] = {"domain": list(dom.y), "anchor": f"x{suffix}",
                                        "automargin": True}
        # the legend sits just above its panel (4 px) and the panel's title above it (28 px)
        fig.layout["legend" + suffix] = {"orientation": "h", "x": dom.x[0], "xanchor": "left",
                                         "y": dom.y[1] + 4 * px, "yanchor": "bottom",
                                         "font": {"size": 11}}
        annotations.append({"text": f"<b>{titles.get(key, panel.title)}</b>", "showarrow": False,
                            "xref": "paper", "yref": "paper", "x": dom.x[0],
                            "y": dom.y[1] + 28 * px,
                            "xanchor": "left", "yanchor": "bottom"})
    if figs.problems:
        annotations.append({"text": "<b>DOES NOT FIT</b>: " + "; ".join(figs.problems),
                            "showarrow": False, "xref": "paper", "yref": "paper", "x": 1.0,
                            "y": 1.0 + 8 * px,
                            "xanchor": "right", "yanchor": "bottom",
                            "font": {"color": L.EVENT_COLORS["not_fit"], "size": 12}})
    fig.update_layout(
        title={"text": title or figs.title, "x": 0.0, "xanchor": "left", "font": {"size": 14}},
        autosize=True, height=grid.height_px,
        font={"family": "Arial, Helvetica, sans-serif", "size": 12},
        margin={"l": 64, "r": 16, "t": L.TOP_PX + (18 if figs.problems else 0), "b": 50},
        annotations=annotations, barmode="group", plot_bgcolor="#FAFAFA", showlegend=True)
    # the timeline's rows top-down (reversed range), with room above the first for its labels
    fig.update_yaxes(selector={"anchor": "x"}, tickvals=list(range(view.rows)),
                     ticktext=view.labels, range=[view.rows - 0.5, -0.7], zeroline=False)
    fig.layout.yaxis3.title = {"text": "GB/s"}
    fig.layout.yaxis3.rangemode = "tozero"
    fig.layout.xaxis4.title = {"text": "GB"}
    fig.layout.yaxis2.autorange = "reversed"
    return fig


def link_category(label: str, f: LinkFigure) -> str:
    """"D2H · 95.1 GB/s · busy 21 %": a link bar's x category, its numbers included."""
    if math.isnan(f.gbps_busy):
        return f"{label} · nothing moved"
    return f"{label} · {f.gbps_busy:.3g} GB/s · busy {f.busy_pct:.2g} %"


def sim_panels(figs: SimFigures) -> list[str]:
    """The simulated panels with data (no link panel when nothing crosses the link)."""
    has_link = any(not math.isnan(f.gbps_busy) for f in figs.link.values())
    return [k for k in L.SIMULATED if k != "link" or has_link
            if k != "memory" or figs.memory]
