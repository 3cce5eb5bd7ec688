"""What the measured figure writes on top of its traces: panel titles, the labels and lines of
reconfigurations, the bands of A/B trials, the "waiting" notice. Pure dicts of plotly layout
(annotations and shapes); `XMap` places an iteration on the per-iteration panels' x axis
(iterations, or seconds of wall clock)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.state import DashboardState, TrialNotes
from superoffload.widgets.dashboard.timeline import TimelineView
from superoffload.widgets.dashboard.traces import rgba

WAITING = "waiting for the first complete iteration"
XMap = Callable[[float], float]
"""An iteration -> its x on the per-iteration panels."""


def panel_annotations(grid: L.Grid, panels: Sequence[str], titles: dict[str, str],
                      marks: Sequence[tuple[int, str]], *, x_of: XMap, waiting: bool = False,
                      trials: Sequence[TrialNotes] = ()) -> list[dict[str, Any]]:
    """Panel titles above each panel; a label per reconfiguration (the newest three) at the
    bottom of the iteration-time panel beside its dashed line, on an opaque box (a spike
    never crosses it: the line is above the axis' zero); "waiting for the first complete
    iteration" across the timeline until there is one."""
    px = 1.0 / grid.height_px
    out: list[dict[str, Any]] = []
    for key in panels:
        dom = grid.domains[key]
        title = titles.get(key, L.MEASURED[key].title)
        out.append({"text": f"<b>{title}</b>", "showarrow": False, "xref": "paper",
                    "yref": "paper", "x": dom.x[0], "y": dom.y[1] + 3 * px,
                    "xanchor": "left", "yanchor": "bottom", "font": {"size": 12}})
    if "speed" in panels:
        color = L.EVENT_COLORS["reconfigure"]
        labels = [(at, short_change(text)) for at, text in marks]
        labels += [(t.start, "A/B " + short_change(t.what)) for t in trials]
        for at, text in sorted(labels)[-3:]:
            out.append({"text": text, "showarrow": False, "xref": "x2",
                        "yref": "y2 domain", "x": x_of(at), "y": 0.02, "xanchor": "left",
                        "yanchor": "bottom", "font": {"size": 10, "color": color},
                        "bgcolor": "#FFFFFF", "bordercolor": color, "borderwidth": 1,
                        "borderpad": 2})
    if waiting and "timeline" in panels:
        out.append({"text": WAITING, "showarrow": False, "xref": "x domain", "yref": "y domain",
                    "x": 0.5, "y": 0.5, "font": {"size": 14, "color": "#555555"},
                    "bgcolor": "#FFFFFF"})
    return out


def short_change(note: str) -> str:
    """"reconfigure applied: ratio 0.5 -> 0.8" -> "ratio 0.5→0.8"."""
    text = note.split(":", 1)[1].strip() if note.startswith("reconfigure applied") else note
    return text.replace(" -> ", "→")


def reconfigure_shapes(state: DashboardState, view: TimelineView, panels: Sequence[str], *,
                       x_of: XMap) -> list[dict[str, Any]]:
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
                        "x0": x_of(t.start), "x1": x_of(end), "y0": 0, "y1": 1, "layer": "below",
                        "fillcolor": rgba(color, 0.08), "line": {"width": 0}})
    for at, _text in state.reconfigures:
        for key in panels:
            suffix = L.AXIS[key]
            if key == "timeline":
                if at not in view.boundaries:
                    continue
                x = view.boundaries[at]
            else:
                x = x_of(at)
            out.append({"type": "line", "xref": f"x{suffix}", "yref": f"y{suffix} domain",
                        "x0": x, "x1": x, "y0": 0, "y1": 1, "line": line})
    return out
