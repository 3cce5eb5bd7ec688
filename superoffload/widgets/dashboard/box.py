"""The live dashboard's widgets: a status line, a row of controls, the live figure and its
fallback, in one box (`.so-dashboard`; the browser test measures it against one screen).

The live figure is a `LivePlot` (widgets/shared/liveplot.py). Its browser side says "initialized"
once its model has started; a model that fails to (anywidget gives it 2 s) never does, and
then the box falls back to a figure redrawn in place every `FALLBACK_EVERY_S` by JupyterLab's
own plotly renderer (a plotly output inside an `ipywidgets.Output`, a core widget that has
no such time limit), titled to say why; the status line says it too (`fallback_line`).
The rule (`fallback_due`, pure): the figure has data and the live figure has not said it
started `FALLBACK_AFTER_S` after it was shown. While a cell holds the kernel's main thread
(`trainer.train()` in its cell) the kernel cannot hear the browser at all, so the fallback is
fed then too; a live figure that works hides it in the page and stops it from drawing, and
the kernel stops feeding it once the "initialized" message is read.

Widths are "auto", not "100%": a widget has 2 px margins on each side, so a 100 % box is 4 px
wider than its output area and every figure got a horizontal scrollbar (the browser test's
layout check compares each view's box with its output area).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from superoffload.widgets.shared import env
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.liveplot import FALLBACK_CLASS

FALLBACK_AFTER_S = 8.0
"""Seconds after the live figure was shown without a word from it before the fallback draws
(anywidget fails a model after 2 s; the rest is the message's way back on a busy kernel)."""
FALLBACK_EVERY_S = 3.0
"""Seconds between two redraws of the fallback figure (each one is a whole new plot)."""
FALLBACK_TITLE = ("the live figure did not start in this browser (its widget model failed to "
                  f"initialize): this copy is redrawn every {FALLBACK_EVERY_S:.0f} s")


def fallback_due(*, now_s: float, shown_s: float | None, initialized: bool, has_data: bool,
                 last_s: float) -> bool:
    """Whether the fallback figure is redrawn now (module docstring)."""
    if initialized or shown_s is None or not has_data:
        return False
    return now_s - shown_s >= FALLBACK_AFTER_S and now_s - last_s >= FALLBACK_EVERY_S


class LiveBox:
    """Status line, controls (`toolbar`, optional), `LivePlot` and fallback, in one VBox."""

    def __init__(self, config: dict[str, Any], toolbar: Any = None) -> None:
        import ipywidgets as w

        from superoffload.widgets.shared.liveplot import live_plot_class

        self.config = dict(config)
        self.status = w.HTML(value="", layout=w.Layout(width="auto"))
        self.status.add_class("so-dash-status")
        self.fallback = w.Output(layout=w.Layout(width="auto"))
        self.fallback.add_class("so-dash-fallback")
        self.fallback.add_class(FALLBACK_CLASS)
        children = [self.status] if toolbar is None else [self.status, toolbar]
        self.box = w.VBox(children, layout=w.Layout(width="auto"))
        self.box.add_class("so-dashboard")
        self.plot = live_plot_class()(config=self.config, box=self.box.model_id,
                                      fallback=self.fallback.model_id)
        self.plot.add_class("so-dashboard-plot")
        self.plot.layout.width = "auto"
        self.box.children = (*children, self.plot, self.fallback)
        self.shown_s: float | None = None
        """When the box was shown (time.monotonic); None before."""
        self.fallback_on = False
        """Whether the fallback figure is being drawn (the live one said nothing in time)."""
        self._fallback_s = -float("inf")

    def mark_shown(self) -> None:
        if self.shown_s is None:
            self.shown_s = time.monotonic()

    @property
    def initialized(self) -> bool:
        return self.plot.initialized_s is not None

    def failed(self) -> bool:
        """True when the live figure's model is known not to have started: the fallback is
        drawing and the kernel could have heard from it (`env.kernel_can_hear`)."""
        return self.fallback_on and not self.initialized and env.kernel_can_hear()

    def show(self, fig: dict[str, Any], lines: list[str], *, changed: bool,
             has_data: bool) -> None:
        """Send `fig` to the live figure when it `changed`; redraw the fallback when due."""
        if changed or not self.plot.figure:
            self.plot.show_figure(fig)
        now = time.monotonic()
        if self.initialized and self.fallback_on:
            # the live figure spoke at last: the page hid the copy
            self.fallback_on = False
            self.fallback.outputs = ()
        elif fallback_due(now_s=now, shown_s=self.shown_s, initialized=self.initialized,
                          has_data=has_data, last_s=self._fallback_s):
            self.fallback_on = True
            self._fallback_s = now
            copy_fig = {"data": fig["data"], "layout": copy.deepcopy(fig["layout"])}
            copy_fig["layout"]["title"]["text"] = FALLBACK_TITLE
            copy_fig["layout"]["margin"]["t"] = 30
            bundle = snap.figure_bundle(copy_fig, lines, self.config)
            self.fallback.outputs = ({"output_type": "display_data", "data": bundle,
                                      "metadata": {}},)

    @staticmethod
    def fallback_line() -> str:
        """What the status says while the fallback draws in place of a failed live figure."""
        return ("the live figure did not start in this browser (its widget model failed to "
                f"initialize); the figure below is a copy redrawn every {FALLBACK_EVERY_S:.0f} s")

    def end(self) -> None:
        """The run ended: a page that renders this box later freezes it (liveplot.js)."""
        self.plot.ended = True
