"""Outputs that survive the kernel: static snapshots beside (or instead of) live widgets.

A widget's output in a saved notebook is only a reference to a model that lives in the
kernel; reopened later it reads "Error displaying widget: model not found". So every view
keeps an output slot (an IPython display id) it can rewrite:

  * a static figure is a plotly mime bundle (`application/vnd.plotly.v1+json`, drawn by
    JupyterLab's plotly renderer without a kernel) plus an HTML and a plain-text summary
    (what nbconvert and terminals show);
  * every live view (the dashboard, the trainer's progress line and its status lines, the
    tuner) shows its widget in a slot while the run is going and replaces it IN PLACE with a
    static snapshot when the run ends, so a notebook saved afterwards opens with the
    figure and the last state instead of "model not found";
  * views still live when the kernel shuts down are frozen (`freeze_all`) when the
    front-end asks the kernel to shut down or restart, before the kernel replies
    (`_env.on_kernel_shutdown`): after the reply the server may tear the channels down
    before late output reaches the page. Any other exit runs it from an `atexit` hook,
    before ipykernel closes its output channel (atexit runs the newest hook first).
    At that moment the static outputs already shown are sent again too: a run that ended
    while no page showed the notebook sent its snapshot to nobody.
  * a kernel that restarts or dies cannot do any of this (the page drops what the old kernel
    sends once a restart begins): the live figure's own page code replaces our live views in
    the notebook then (widgets/shared/liveplot.js).

A "warning:" line of a status is drawn in orange and bold, a "note:" line stays unfolded
(html_lines).
"""

from __future__ import annotations

import atexit
import contextlib
import html
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared.plotjson import plotly_json

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WARNING_STYLE = "color:#B34700;font-weight:bold"
_ids = itertools.count()


KEEP_IN_VIEW = ("warning:", "note:")
"""Status lines that are never folded away (html_lines)."""


def _line(k: int, text: str) -> str:
    if k == 0:
        return f"<b>{html.escape(text)}</b>"
    if text.startswith("warning:"):
        return f"<span class='so-warning' style='{WARNING_STYLE}'>{html.escape(text)}</span>"
    return html.escape(text)


def html_lines(lines: Sequence[str], *, css_class: str = "so-snapshot",
               fold_after: int | None = None) -> str:
    """Plain-text lines as escaped HTML (the first one bold, a "warning:" line coloured).
    `fold_after`: the lines past the first `fold_after` (warnings and notes excepted: they
    stay in view) fold under a "details" toggle, closed (a status that fits one screen)."""
    shown = list(enumerate(lines))
    folded: list[tuple[int, str]] = []
    if fold_after is not None:
        shown = [(k, t) for k, t in enumerate(lines)
                 if k < fold_after or t.startswith(KEEP_IN_VIEW)]
        folded = [(k, t) for k, t in enumerate(lines) if (k, t) not in shown]
    body = "<br>".join(_line(k, t) for k, t in shown)
    if folded:
        body += ("<details class='so-details'><summary style='cursor:pointer;color:#555'>details"
                 "</summary>" + "<br>".join(_line(k, t) for k, t in folded) + "</details>")
    return (f"<div class='{css_class}' style='font-family:sans-serif;font-size:12px;"
            f"line-height:1.45'>{body}</div>")


def figure_bundle(fig: dict[str, Any], lines: Sequence[str],
                  config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A static plotly figure (a figure dict, `plotjson`) with its summary, as a display mime
    bundle (drawn by JupyterLab's plotly renderer, no kernel needed)."""
    data = plotly_json({"data": fig["data"], "layout": fig["layout"]})
    data["config"] = dict(config or {"responsive": True, "displaylogo": False})
    return {PLOTLY_MIME: data, "text/html": html_lines(lines), "text/plain": "\n".join(lines)}


def text_bundle(lines: Sequence[str], *, css_class: str = "so-snapshot") -> dict[str, Any]:
    return {"text/html": html_lines(lines, css_class=css_class), "text/plain": "\n".join(lines)}


def widget_bundle(widget: Any, lines: Sequence[str]) -> dict[str, Any]:
    """A live widget's bundle (its text/plain fallback replaced by the summary)."""
    bundle = dict(widget._repr_mimebundle_())
    bundle["text/plain"] = "\n".join(lines)
    return bundle


class OutputSlot:
    """One output place in the notebook, rewritable from any thread (`update_display`)."""

    def __init__(self, name: str) -> None:
        self.display_id = f"superoffload-{name}-{next(_ids)}"
        self.shown = False
        self.bundle: dict[str, Any] | None = None
        _slots.add(self)

    @property
    def frozen(self) -> bool:
        """True when what the slot shows needs no kernel (no live widget in it)."""
        return self.bundle is not None and WIDGET_MIME not in self.bundle

    def show(self, bundle: dict[str, Any]) -> None:
        """Display here (a new output in the running cell); later `update`s rewrite it. The
        first view of ours a page shows starts loading the live figure's plotly.js there
        (`liveplot.prepare_page`): a dashboard shown later draws at once."""
        from IPython.display import display

        from superoffload.widgets.shared.liveplot import prepare_page

        prepare_page()
        self.bundle = bundle
        display(bundle, raw=True, display_id=self.display_id)
        self.shown = True

    def resend(self) -> None:
        """Send a frozen slot's bundle again (a page that missed it gets it now)."""
        if self.frozen and self.bundle is not None:
            self.update(self.bundle)

    def clear(self) -> None:
        """Leave the output empty (a placeholder whose content appeared elsewhere)."""
        self.update({"text/plain": ""})

    def update(self, bundle: dict[str, Any]) -> None:
        """Rewrite every output this slot was shown in (no-op before `show`)."""
        self.bundle = bundle
        if self.shown and _env.in_notebook():
            from IPython.display import update_display

            update_display(bundle, raw=True, display_id=self.display_id)


def placeholder(text: str) -> OutputSlot:
    """Show `text` in the running cell now (e.g. "measuring this machine ..." where a view
    will appear after a slow step); `.clear()` it when the view is shown. Outside a notebook
    the text is printed."""
    slot = OutputSlot("placeholder")
    if _env.in_notebook():
        slot.show(text_bundle([text]))
    else:
        print(text)
    return slot


class Freezable(Protocol):
    def freeze(self) -> None:
        """Replace every live widget of the view with its static snapshot."""


EXIT_NOTE = "(frozen here when the kernel shut down)"
exiting = False
"""True once `freeze_all` ran: the snapshots say the kernel went, not the run's end."""
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_slots: weakref.WeakSet[OutputSlot] = weakref.WeakSet()
_live_lock = threading.Lock()
_hooked = False


def register(view: Freezable) -> None:
    """Freeze `view` when the kernel shuts down, unless it was frozen before."""
    global _hooked
    with _live_lock:
        _live.add(view)
        if not _hooked:
            # a shutdown asked by the front-end
            _env.on_kernel_shutdown(freeze_all)
            # any other exit of the process
            atexit.register(freeze_all)
            _hooked = True


def unregister(view: Any) -> None:
    with _live_lock:
        _live.discard(view)


def freeze_all() -> int:
    """Freeze every registered live view (the kernel's exit calls this); returns how many.
    A view that fails to freeze does not stop the others."""
    global exiting
    with _live_lock:
        views = list(_live)
        _live.clear()
        exiting = True
    # the cheap ones first (a line of text each), a dashboard's figure last
    views.sort(key=lambda v: not isinstance(v, LiveOutput))
    for view in views:
        # at exit, one broken view must not hide the rest
        with contextlib.suppress(Exception):
            view.freeze()
    # snapshots sent while no page showed the notebook, again
    for slot in list(_slots):
        with contextlib.suppress(Exception):
            slot.resend()
    return len(views)


class LiveOutput:
    """A live widget in its own slot, frozen in place into a static snapshot
    (`lines()`, plain text, plus optional HTML) at the run's end or the kernel's exit."""

    def __init__(self, name: str, widget: Any, lines: Callable[[], list[str]], *,
                 css_class: str = "so-snapshot") -> None:
        self.slot = OutputSlot(name)
        self.widget = widget
        self.lines = lines
        self.css_class = css_class

    def show(self) -> None:
        """Display the widget in the running cell; register for the kernel's exit."""
        self.slot.show(widget_bundle(self.widget, self.lines()))
        register(self)

    def freeze(self) -> None:
        """Replace the widget with its static snapshot (no-op before `show`)."""
        unregister(self)
        if self.slot.shown:
            lines = [*self.lines(), *([EXIT_NOTE] if exiting else [])]
            self.slot.update(text_bundle(lines, css_class=self.css_class))
