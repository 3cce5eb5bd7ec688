"""`LivePlot`: a one-way live plotly view (kernel -> browser only), for a busy kernel.

Why not plotly's FigureWidget: after every update its browser side sends the whole computed
layout and every trace's computed defaults back to the kernel, and ipywidgets echoes those
messages back again. Messages from the browser are handled on the kernel's main thread,
which shares the GIL with the training thread and the engine's lanes; on a loaded 2-core
machine the returning deltas of a six-panel figure refreshed twice a second queued up there
and delayed a slider move or a button press by minutes. This widget only receives: the
kernel assigns the figure's JSON to one trait (`figure`, never echoed), and the browser
redraws it with `Plotly.react` (which keeps zoom and hidden traces: `layout.uirevision`).

How the browser side draws (`_JS_RENDER`), so that a figure can neither stay empty nor stop:

* **The newest figure, when it can be seen.** A new figure marks the view dirty; a draw
  runs only while the view is on screen (an IntersectionObserver, with a margin, on the
  widget's element: JupyterLab's default windowing skips the rendering of off-screen cells,
  and a notebook run with Run All is mostly off screen). When the view comes back into
  view, it draws the newest figure at once. Intermediate figures are dropped, never queued.
* **No draw can block the next.** A draw that has not settled after `DRAW_TIMEOUT_MS`
  is abandoned: its plot element is purged and replaced by a fresh one, and the newest
  figure is drawn there (`dataset.stalls` counts these). A draw that fails is recorded in
  `dataset.drawError` and the next figure is drawn as usual. (The previous version kept a
  `drawing` flag for the whole of `await Plotly.react(...)`; one draw that never settled, as
  seen with an off-screen cell under JupyterLab's windowing, blocked every later one.)
* **The active cell stays in view.** After its first figure with data, a view in the
  notebook's active cell (where Run All leaves the view) scrolls just enough to be seen whole
  (`scrollIntoView({block: "nearest"})`, once): its own growth from a status line to a
  full figure would otherwise push its bottom out of sight. Views in other cells never
  scroll the notebook.
* For tests and the curious: `dataset.draws` (figures drawn), `dataset.drawMs` (the last
  one's cost), `dataset.pending` ("hidden" while a newer figure waits for the view to be
  seen), `dataset.stalls`; `el.soLivePlot.react` is the draw function (a test replaces it
  with one that never settles, to check the recovery).

plotly.js comes from the plotly package (`package_data/plotly.min.js`, a UMD bundle), wrapped
into the widget's ES module once per kernel: ~5 MB sent to the browser per widget, as plotly's
own FigureWidget does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DRAW_TIMEOUT_MS = 8000
"""A draw still unsettled after this long is abandoned and redrawn on a fresh element (a
draw of the dashboard takes 50-500 ms on a loaded 2-core machine)."""
VISIBLE_MARGIN_PX = 300
"""A view this close to the visible area already counts as visible (drawn just before it
scrolls in)."""

_JS_RENDER = r"""
const DRAW_TIMEOUT_MS = __DRAW_TIMEOUT_MS__;
const VISIBLE_MARGIN_PX = __VISIBLE_MARGIN_PX__;

function render({ model, el }) {
  el.classList.add("so-liveplot");
  const hooks = { react: (div, data, layout, config) => Plotly.react(div, data, layout, config),
                  state: () => ({ visible, dirty, drawing: !!inFlight, scheduled: !!timer }) };
  el.soLivePlot = hooks;
  let div = null;
  let dirty = true;         // a figure newer than the one drawn is waiting
  let inFlight = null;      // the draw running now: {started, div}
  let visible = false;
  let timer = 0, timerDue = Infinity;
  const count = (key) => { el.dataset[key] = String(Number(el.dataset[key] || 0) + 1); };

  function freshDiv() {
    const d = document.createElement("div");
    d.style.width = "100%";
    el.appendChild(d);
    return d;
  }
  div = freshDiv();

  function schedule(ms) {  // one timer: the earliest of the pumps asked for
    const due = performance.now() + ms;
    if (timer && due >= timerDue) return;
    clearTimeout(timer);
    timerDue = due;
    timer = setTimeout(() => { timer = 0; timerDue = Infinity; pump(); }, ms);
  }

  function onScreen() {
    // the element's box now decides: the observer only wakes the pump when the view comes
    // into sight (its first report can precede the cell's layout under JupyterLab's
    // windowing, and then no change of intersection follows to correct it)
    if (!el.isConnected) return (visible = false);
    const r = el.getBoundingClientRect();
    visible = r.width > 0 && r.bottom > -VISIBLE_MARGIN_PX &&
              r.top < window.innerHeight + VISIBLE_MARGIN_PX;
    return visible;
  }

  function pump() {
    if (!dirty) return;
    if (!onScreen()) { el.dataset.pending = "hidden"; return; }
    if (inFlight) {
      const waited = performance.now() - inFlight.started;
      if (waited < DRAW_TIMEOUT_MS) { schedule(DRAW_TIMEOUT_MS - waited + 20); return; }
      // a draw that never settled: abandon its element, draw the newest figure afresh
      count("stalls");
      const stale = inFlight.div;
      inFlight = null;
      try { Plotly.purge(stale); } catch (e) { /* it may be half-built */ }
      stale.remove();
      div = freshDiv();
    }
    dirty = false;
    delete el.dataset.pending;
    const fig = model.get("figure") || {};
    const mine = { started: performance.now(), div: div };
    inFlight = mine;
    let drawn;
    try {
      drawn = Promise.resolve(hooks.react(div, fig.data || [], fig.layout || {}, model.get("config") || {}));
    } catch (e) {
      drawn = Promise.reject(e);
    }
    drawn.then(() => {
      if (inFlight !== mine) return;  // abandoned meanwhile: its figure was drawn again
      count("draws");
      el.dataset.drawMs = String(Math.round(performance.now() - mine.started));
      if (!el.dataset.settled && (fig.data || []).some(t => t.x && (t.x.length || t.x.bdata))) keepInView();
    }, (e) => {
      if (inFlight === mine) el.dataset.drawError = String(e && e.message || e);
    }).finally(() => {
      if (inFlight !== mine) return;
      inFlight = null;
      if (dirty) schedule(0);
    });
    watchdog(mine);
  }

  function watchdog(draw) {  // pump() again if this draw never settles
    setTimeout(() => { if (inFlight === draw) { dirty = true; pump(); } }, DRAW_TIMEOUT_MS + 20);
  }

  function keepInView() {
    // Once, after the first figure with data: if this view's cell is the active one (Run All
    // leaves the last cell active and in view), the figure's own growth must not push the
    // view's bottom out of sight. A view in any other cell never scrolls the notebook.
    el.dataset.settled = "1";
    const cell = el.closest(".jp-Cell");
    if (cell && cell.classList.contains("jp-mod-active")) {
      (el.closest(".so-dashboard") || el).scrollIntoView({ block: "nearest" });
    }
  }

  function figureChanged() { dirty = true; schedule(0); }
  model.on("change:figure", figureChanged);
  model.on("change:config", figureChanged);

  const seen = new IntersectionObserver((entries) => {
    if (entries[entries.length - 1].isIntersecting) schedule(0);
  }, { rootMargin: `${VISIBLE_MARGIN_PX}px` });
  seen.observe(el);
  const resize = new ResizeObserver(() => {
    if (dirty) schedule(0);  // laid out at last (a cell re-attached, a panel resized)
    if (!visible || inFlight || !div.data) return;
    Promise.resolve(Plotly.Plots.resize(div)).catch(() => {});  // rejects when hidden: harmless
  });
  resize.observe(el);
  return () => {
    seen.disconnect();
    resize.disconnect();
    clearTimeout(timer);
    try { Plotly.purge(div); } catch (e) { /* already gone */ }
  };
}
export default { render };
"""

_CLASS: Any = None


def render_js() -> str:
    """The browser side of `LivePlot` (without plotly.js): what `_esm` wraps."""
    return (_JS_RENDER.replace("__DRAW_TIMEOUT_MS__", str(DRAW_TIMEOUT_MS))
            .replace("__VISIBLE_MARGIN_PX__", str(VISIBLE_MARGIN_PX)))


def plotly_bundle() -> Path:
    """plotly.js as the plotly package ships it (a UMD bundle)."""
    import plotly

    bundle = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not bundle.exists():
        raise FileNotFoundError(f"{bundle} is missing: reinstall plotly (pip install --force-reinstall plotly)")
    return bundle


def _esm() -> str:
    # the bundle is UMD: given a CommonJS-like `module` it exports Plotly instead of a global
    return ("const module = { exports: {} };\n(function (module) {\n"
            + plotly_bundle().read_text(encoding="utf-8")
            + "\n})(module);\nconst Plotly = module.exports;\n" + render_js())


def live_plot_class() -> Any:
    """The widget class (built on first use: it needs anywidget and plotly)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import anywidget
    import traitlets

    class LivePlot(anywidget.AnyWidget):  # type: ignore[misc]
        _esm = _esm()
        figure = traitlets.Dict().tag(sync=True, echo_update=False)
        config = traitlets.Dict().tag(sync=True, echo_update=False)

        def show_figure(self, fig: Any) -> None:
            """Send `fig` (a plotly Figure) to every view of this widget."""
            import plotly.io as pio

            self.figure = json.loads(pio.to_json(fig, validate=False))

    _CLASS = LivePlot
    return _CLASS
