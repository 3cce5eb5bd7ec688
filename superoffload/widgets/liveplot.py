"""`LivePlot`: a one-way live plotly view (kernel -> browser only), for a busy kernel.

Why not plotly's FigureWidget: after every update its browser side sends the whole computed
layout and every trace's computed defaults back to the kernel, and ipywidgets echoes those
messages back again. Messages from the browser are handled on the kernel's main thread,
which shares the GIL with the training thread and the engine's lanes; on a loaded 2-core
machine the returning deltas of a six-panel figure refreshed twice a second queued up there
and delayed a slider move or a button press by minutes. This widget only receives: the
kernel assigns the figure's JSON to one trait (`figure`, never echoed), and the browser
redraws it with `Plotly.react` (which keeps zoom and hidden traces: `layout.uirevision`),
dropping intermediate figures when it cannot keep up.

plotly.js comes from the plotly package (`package_data/plotly.min.js`, a UMD bundle), wrapped
into the widget's ES module once per kernel: ~5 MB sent to the browser per widget, as plotly's
own FigureWidget does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_JS_RENDER = r"""
function render({ model, el }) {
  const div = document.createElement("div");
  div.style.width = "100%";
  el.appendChild(div);
  el.classList.add("so-liveplot");
  let drawing = false, again = false;
  async function draw() {
    if (drawing) { again = true; return; }  // draw the newest figure once this one is done
    drawing = true;
    try {
      do {
        again = false;
        const fig = model.get("figure") || {};
        const t0 = performance.now();
        await Plotly.react(div, fig.data || [], fig.layout || {}, model.get("config") || {});
        // for tests and the curious: how many figures were drawn, the last one's cost
        el.dataset.draws = String(Number(el.dataset.draws || 0) + 1);
        el.dataset.drawMs = String(Math.round(performance.now() - t0));
      } while (again);
    } finally { drawing = false; }
  }
  model.on("change:figure", draw);
  draw();
  const resize = new ResizeObserver(() => { if (div.data) Plotly.Plots.resize(div); });
  resize.observe(el);
  return () => { resize.disconnect(); Plotly.purge(div); };
}
export default { render };
"""

_CLASS: Any = None


def _esm() -> str:
    import plotly

    bundle = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not bundle.exists():
        raise FileNotFoundError(f"{bundle} is missing: reinstall plotly (pip install --force-reinstall plotly)")
    # the bundle is UMD: given a CommonJS-like `module` it exports Plotly instead of a global
    return ("const module = { exports: {} };\n(function (module) {\n" + bundle.read_text(encoding="utf-8")
            + "\n})(module);\nconst Plotly = module.exports;\n" + _JS_RENDER)


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
