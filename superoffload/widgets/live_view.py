"""The live dashboard's widgets: a status line, a row of controls and a one-way plotly view,
in one box (`.so-dashboard`; the browser test measures it against one screen).

Widths are "auto", not "100%": a widget has 2 px margins on each side, so a 100 % box is 4 px
wider than its output area and every figure got a horizontal scrollbar (the browser test's
layout check compares each view's box with its output area).
"""

from __future__ import annotations

from typing import Any


def live_view(config: dict[str, Any], toolbar: Any = None) -> tuple[Any, Any, Any]:
    """(status HTML, LivePlot, the box holding them and `toolbar` between them), classed for
    the browser test."""
    import ipywidgets as w

    from superoffload.widgets.liveplot import live_plot_class

    status = w.HTML(value="", layout=w.Layout(width="auto"))
    status.add_class("so-dash-status")
    plot = live_plot_class()(config=dict(config))
    plot.add_class("so-dashboard-plot")
    plot.layout.width = "auto"
    children = [status, plot] if toolbar is None else [status, toolbar, plot]
    box = w.VBox(children, layout=w.Layout(width="auto"))
    box.add_class("so-dashboard")
    return status, plot, box
