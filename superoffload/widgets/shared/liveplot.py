"""`LivePlot`: a one-way live plotly view (kernel -> browser only), for a busy kernel.

Why not plotly's FigureWidget: after every update its browser side sends the whole computed
layout and every trace's computed defaults back to the kernel, and ipywidgets echoes those
messages back again. Messages from the browser are handled on the kernel's main thread,
which shares the GIL with the training thread and the engine's lanes; on a loaded 2-core
machine the returning deltas of a six-panel figure refreshed twice a second queued up there
and delayed a slider move or a button press by minutes. This widget only receives: the
kernel assigns the figure (`plotjson.pack`: its arrays as binary frames) to one trait, never
echoed, and the browser redraws it with `Plotly.react` (which keeps zoom and hidden traces:
`layout.uirevision`). The one message the browser sends is "initialized", once.

Why its module is small and plotly.js travels apart: anywidget gives a model 2 s to import
its module and run `initialize`; with plotly.js inside (4.8 MB) that import took 9-12 s on a
busy page, the model never initialized, and the figure stayed blank for the whole run. Now
the module is a few KB; plotly.js is sent once per kernel in a `PlotlyLibrary` (a core widget
model holding the bundle's bytes, which no time limit applies to) and evaluated once per page
(`liveplot.js`). A model that still fails to initialize is caught by the dashboard, which
falls back to a figure redrawn in place (widgets/dashboard/box.py).

How the browser draws (`liveplot.js`), so that a figure can neither stay empty nor stop:

* **The newest figure, when it can be seen.** A new figure marks the view dirty; a draw
  runs only while the view is on screen (JupyterLab's default windowing skips the rendering
  of off-screen cells, and a notebook run with Run All is mostly off screen). When the view
  comes back into view, it draws the newest figure at once. Intermediate figures are dropped.
* **No draw can block the next.** A draw that has not settled after `DRAW_TIMEOUT_MS` is
  abandoned: its plot element is purged and replaced, and the newest figure is drawn there
  (`dataset.stalls` counts these). A draw that fails is recorded in `dataset.drawError`.
* **The active cell stays in view.** After its first figure with data, a view in the
  notebook's active cell scrolls just enough to be seen whole (once).
* **Every ending leaves a static output.** When the kernel restarts or dies, the page can no
  longer hear it; the module replaces our live views in the notebook by static outputs
  itself (the dashboard by its figure), so a notebook saved afterwards reopens with them.
* For tests: `dataset.draws`, `drawMs`, `pending` ("hidden", or "plotly" while plotly.js
  loads), `stalls`, `firstDataMs` / `firstDrawnMs` / `dataToDrawMs` (the first figure with
  data: when it arrived, when it was drawn); `el.soLivePlot.react` is the draw function.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from superoffload.widgets.shared.plotjson import pack

DRAW_TIMEOUT_MS = 8000
"""A draw still unsettled after this long is abandoned and redrawn on a fresh element (a
draw of the dashboard takes 50-500 ms on a loaded 2-core machine)."""
VISIBLE_MARGIN_PX = 300
"""A view this close to the visible area already counts as visible (drawn just before it
scrolls in)."""
JS_FILE = Path(__file__).with_name("liveplot.js")
FALLBACK_CLASS = "so-live-fallback"
"""The class of a fallback figure beside a live one: hidden once the live one works."""

_CLASSES: dict[str, Any] = {}
_library: Any = None
_early: Any = None
_lock = threading.Lock()


def render_js() -> str:
    """The browser side of `LivePlot` (without plotly.js): its ES module."""
    import plotly

    return (JS_FILE.read_text(encoding="utf-8")
            .replace("__DRAW_TIMEOUT_MS__", str(DRAW_TIMEOUT_MS))
            .replace("__VISIBLE_MARGIN_PX__", str(VISIBLE_MARGIN_PX))
            .replace("__PLOTLY_VERSION__", str(plotly.__version__)))


def plotly_bundle() -> Path:
    """plotly.js as the plotly package ships it (a UMD bundle)."""
    import plotly

    bundle = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not bundle.exists():
        raise FileNotFoundError(f"{bundle} is missing: reinstall plotly "
                                "(pip install --force-reinstall plotly)")
    return bundle


def plotly_library() -> Any:
    """The kernel's one `PlotlyLibrary` (made on first use): plotly.js for every live view."""
    global _library
    with _lock:
        if _library is None:
            import ipywidgets
            import traitlets

            class PlotlyLibrary(ipywidgets.Widget):  # type: ignore[misc]
                """plotly.js's bytes in a core widget model (no view, no module to load:
                anywidget's time limit does not apply to it)."""

                source = traitlets.Bytes().tag(sync=True)

            _library = PlotlyLibrary(source=plotly_bundle().read_bytes())
        return _library


def prepare_page() -> bool:
    """Start loading the live figure's plotly.js in the notebook's page now, once per kernel
    (a model of a `LivePlot` that is never shown: its module loads plotly.js when it starts),
    so a dashboard shown later draws its first data at once instead of after plotly.js's
    evaluation (seconds on a slow or busy page). Called when the first view of ours is shown
    (widgets/shared/slots.py); a notebook may call it in its first cell. True when the page
    will be prepared (in a notebook, with anywidget and plotly)."""
    global _early
    from superoffload.widgets.shared import env

    if not (env.in_notebook() and env.live_widgets_available()):
        return False
    with _lock:
        if _early is not None:
            return True
    plot = live_plot_class()()
    with _lock:
        if _early is None:
            _early = plot
    return True


def live_plot_class() -> Any:
    """The widget class (built on first use: it needs anywidget and plotly)."""
    with _lock:
        if "LivePlot" in _CLASSES:
            return _CLASSES["LivePlot"]
        import anywidget
        import traitlets

        class LivePlot(anywidget.AnyWidget):  # type: ignore[misc]
            _esm = render_js()
            # a box whose live figure works hides its fallback (liveplot.js marks the box);
            # anywidget loads a model's CSS even when its module fails
            _css = f".so-live-ok .{FALLBACK_CLASS} {{ display: none; }}"
            figure = traitlets.Dict().tag(sync=True, echo_update=False)
            config = traitlets.Dict().tag(sync=True, echo_update=False)
            library = traitlets.Unicode().tag(sync=True)
            """The `PlotlyLibrary` model's id."""
            box = traitlets.Unicode().tag(sync=True)
            """The model id of the output this view lives in (the page freezes it)."""
            fallback = traitlets.Unicode().tag(sync=True)
            """The fallback figure's model id (this view hides it once it works)."""
            ended = traitlets.Bool(False).tag(sync=True)
            """The run ended: a page that renders this view afterwards freezes it."""
            token = traitlets.Unicode().tag(sync=True)
            """This widget's own key in the page (anywidget gives each view its own proxy)."""

            def __init__(self, **kw: Any) -> None:
                super().__init__(library=plotly_library().model_id, token=uuid.uuid4().hex, **kw)
                self.initialized_s: float | None = None
                """When the browser said the model started (time.monotonic; None: not yet)."""
                self.sent = 0
                """Figures sent."""
                self.on_msg(self._on_msg)

            def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
                if isinstance(content, dict) and content.get("event") == "initialized":
                    self.initialized_s = time.monotonic()

            def show_figure(self, fig: dict[str, Any]) -> None:
                """Send `fig` (a figure dict, `plotjson`) to every view of this widget."""
                self.figure = pack({"data": fig["data"], "layout": fig["layout"]})
                self.sent += 1

        _CLASSES["LivePlot"] = LivePlot
        return LivePlot
