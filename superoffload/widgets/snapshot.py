"""Outputs that survive the kernel: static snapshots beside (or instead of) live widgets.

A widget's output in a saved notebook is only a reference to a model that lives in the
kernel; reopened later it reads "Error displaying widget: model not found". So every view
keeps an output slot (an IPython display id) it can rewrite:

  * a static figure is a plotly mime bundle (`application/vnd.plotly.v1+json`, drawn by
    JupyterLab's plotly renderer without a kernel) plus an HTML and a plain-text summary
    (what nbconvert and terminals show);
  * a live dashboard shows its widget while the run is going and replaces it with the
    static figure of the last state when the run ends, so a notebook saved afterwards opens
    with the figure; the tuner keeps a small HTML snapshot of its settings and prediction
    under its controls.
"""

from __future__ import annotations

import html
import itertools
import json
from collections.abc import Sequence
from typing import Any

from superoffload.widgets import _env

PLOTLY_MIME = "application/vnd.plotly.v1+json"
_ids = itertools.count()


def html_lines(lines: Sequence[str], *, css_class: str = "so-snapshot") -> str:
    """Plain-text lines as escaped HTML (the first one bold)."""
    body = "<br>".join(f"<b>{html.escape(t)}</b>" if k == 0 else html.escape(t)
                       for k, t in enumerate(lines))
    return (f"<div class='{css_class}' style='font-family:sans-serif;font-size:12px;line-height:1.45'>"
            f"{body}</div>")


def figure_bundle(fig: Any, lines: Sequence[str], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A static plotly figure with its summary, as a display mime bundle."""
    import plotly.io as pio

    data = json.loads(pio.to_json(fig, validate=False))
    data["config"] = dict(config or {"responsive": True, "displaylogo": False})
    return {PLOTLY_MIME: data, "text/html": html_lines(lines), "text/plain": "\n".join(lines)}


def text_bundle(lines: Sequence[str]) -> dict[str, Any]:
    return {"text/html": html_lines(lines), "text/plain": "\n".join(lines)}


def widget_bundle(widget: Any, lines: Sequence[str]) -> dict[str, Any]:
    """A live widget's bundle (its text/plain fallback replaced by the summary)."""
    bundle = dict(widget._repr_mimebundle_())
    bundle["text/plain"] = "\n".join(lines)
    return bundle


class Slot:
    """One output place in the notebook, rewritable from any thread (`update_display`)."""

    def __init__(self, name: str) -> None:
        self.display_id = f"superoffload-{name}-{next(_ids)}"
        self.shown = False
        self.bundle: dict[str, Any] | None = None

    def show(self, bundle: dict[str, Any]) -> None:
        """Display here (a new output in the running cell); later `update`s rewrite it."""
        from IPython.display import display

        self.bundle = bundle
        display(bundle, raw=True, display_id=self.display_id)
        self.shown = True

    def update(self, bundle: dict[str, Any]) -> None:
        """Rewrite every output this slot was shown in (no-op before `show`)."""
        self.bundle = bundle
        if self.shown and _env.in_notebook():
            from IPython.display import update_display

            update_display(bundle, raw=True, display_id=self.display_id)
