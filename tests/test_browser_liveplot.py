"""The live figure's browser side (`widgets/shared/liveplot.py`) alone in Chromium: no JupyterLab, a
fake widget model, the real plotly.js. What a person needs of it, each checked on the page:

* a view off screen draws nothing while figures arrive, and draws the NEWEST one as soon as
  it is scrolled into view (JupyterLab's default windowing skips off-screen cells, and Run
  All leaves the dashboard off screen);
* a draw that never settles does not block the next ones: after the timeout the newest
  figure is drawn on a fresh element (the wedge seen with `drawing` held forever);
* a burst of figures is folded: far fewer draws than figures, the last one drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from superoffload.widgets.shared import liveplot
from tests import browser_support as bs

pytestmark = pytest.mark.browser

PAGE = """<!doctype html><html><head><meta charset='utf-8'></head>
<body style='margin:0'><div id='spacer' style='height:3000px'>spacer</div>
<div id='view' style='width:800px'></div>
<script>
window.figureOf = (n) => {{  // packed as the kernel packs it (plotjson.pack): JSON bytes, no arrays
  const x = Array.from({{length: n}}, (_, i) => i), y = x.map((i) => i * i);
  const fig = {{data: [{{x, y, type: 'scatter', mode: 'lines', name: 'n' + n}}],
               layout: {{height: 300, title: {{text: 'figure ' + n}}}}}};
  return {{json: new DataView(new TextEncoder().encode(JSON.stringify(fig)).buffer), arrays: []}};
}};
window.makeModel = (library) => {{
  const state = {{figure: {{}}, config: {{}}, library: 'lib', token: 'view-1'}}, listeners = {{}};
  const manager = {{get_model: async (id) => library}};  // the PlotlyLibrary model
  return {{state, get: (k) => state[k],
          on: (ev, cb) => (listeners[ev] = listeners[ev] || []).push(cb),
          send: (msg) => (window.sent = window.sent || []).push(msg), widget_manager: manager,
          set: (k, v) => {{
            state[k] = v;
            (listeners['change:' + k] || []).forEach(cb => cb());
          }}}};
}};
window.start = async (js, plotly) => {{
  const bytes = new TextEncoder().encode(plotly);
  const library = {{get: (k) => (k === 'source' ? new DataView(bytes.buffer) : undefined)}};
  const url = URL.createObjectURL(new Blob([js], {{type: 'text/javascript'}}));
  const mod = await import(url);
  window.model = makeModel(library);
  window.view = document.getElementById('view');
  await mod.default.initialize({{model: window.model}});
  mod.default.render({{model: window.model, el: window.view}});
}};
window.drawn = () => {{
  const gd = window.view.querySelector('.js-plotly-plot');
  const ds = window.view.dataset;
  return {{draws: Number(ds.draws || 0), stalls: Number(ds.stalls || 0), pending: ds.pending || '',
          title: gd && gd.layout && gd.layout.title ? gd.layout.title.text : '',
          points: gd && gd._fullData && gd._fullData.length ? gd._fullData[0].x.length : 0,
          plots: window.view.querySelectorAll('.js-plotly-plot').length}};
}};
</script></body></html>"""


@pytest.fixture
def page(tmp_path: Path) -> Any:
    if not Path(bs.CHROMIUM).exists():
        pytest.skip(f"{bs.CHROMIUM} is absent: apt-get install chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    html = tmp_path / "liveplot.html"
    html.write_text(PAGE.format())
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=bs.CHROMIUM, args=bs.CHROMIUM_ARGS)
        try:
            p = browser.new_page(viewport={"width": 1000, "height": 700})
            errors: list[str] = []
            p.on("pageerror", lambda e: errors.append(str(e)))
            p.goto(html.as_uri())
            p.evaluate("([js, plotly]) => window.start(js, plotly)",
                       [liveplot.render_js(), liveplot.plotly_bundle().read_text()])
            yield p
            assert errors == [], errors
        finally:
            browser.close()


def _send(page: Any, n: int) -> None:
    page.evaluate("(n) => window.model.set('figure', window.figureOf(n))", n)


def _wait_drawn(page: Any, title: str, timeout_ms: int) -> dict[str, Any]:
    page.wait_for_function("(t) => window.drawn().title === t", arg=title, timeout=timeout_ms)
    return page.evaluate("() => window.drawn()")


def test_an_off_screen_view_draws_the_newest_figure_when_it_is_scrolled_into_view(
        page: Any) -> None:
    for n in range(1, 6):  # the view is below a 3000 px spacer: off screen
        _send(page, n)
        page.wait_for_timeout(100)
    page.wait_for_timeout(500)
    before = page.evaluate("() => window.drawn()")
    assert before["draws"] == 0 and before["pending"] == "hidden", before
    page.evaluate("() => window.view.scrollIntoView()")
    after = _wait_drawn(page, "figure 5", 5000)
    assert after["points"] == 5 and after["pending"] == "", after
    page.evaluate("() => window.scrollTo(0, 0)")  # off screen again, newer figures arrive
    _send(page, 7)
    page.wait_for_timeout(500)
    assert page.evaluate("() => window.drawn()")["title"] == "figure 5"
    page.evaluate("() => window.view.scrollIntoView()")
    assert _wait_drawn(page, "figure 7", 5000)["points"] == 7


def test_a_draw_that_never_settles_does_not_block_the_next_ones(page: Any) -> None:
    page.evaluate("() => window.view.scrollIntoView()")
    _send(page, 2)
    _wait_drawn(page, "figure 2", 5000)
    # the next draw hangs for good (what an off-screen cell's draw did under windowing)
    page.evaluate("""() => {
      const hooks = window.view.soLivePlot, react = hooks.react;
      hooks.react = (...a) => { hooks.react = react; return new Promise(() => {}); };
    }""")
    _send(page, 3)
    page.wait_for_timeout(300)
    _send(page, 4)  # arrives while the hung draw holds its element
    got = _wait_drawn(page, "figure 4", liveplot.DRAW_TIMEOUT_MS + 5000)
    assert got["stalls"] == 1 and got["points"] == 4 and got["plots"] == 1, got
    _send(page, 5)  # and it keeps drawing at its usual pace afterwards
    assert _wait_drawn(page, "figure 5", 3000)["stalls"] == 1


def test_the_module_is_small_says_it_started_and_loads_plotly_once_per_page(page: Any) -> None:
    # plotly.js travels apart: anywidget gives a module 2 s to load and initialize
    pytest.importorskip("anywidget")
    assert len(liveplot.live_plot_class()._esm) < 40_000, "not 4.8 MB of plotly.js inside"
    assert page.evaluate("() => window.sent") == [{"event": "initialized"}]
    page.evaluate("() => window.view.scrollIntoView()")
    _send(page, 3)
    _wait_drawn(page, "figure 3", 30_000)
    # a second view on the same page reuses the evaluated plotly.js (one per page)
    again = page.evaluate("""async () => {
      const key = Object.keys(globalThis).filter(k => k.startsWith('__superoffload_plotly_'));
      return key.length === 1 && (await globalThis[key[0]]) === window.view.soLivePlot.plotly;
    }""")
    assert again, "plotly.js is evaluated once and shared through globalThis"


def test_a_burst_of_figures_is_folded_into_few_draws_ending_on_the_newest(page: Any) -> None:
    page.evaluate("() => window.view.scrollIntoView()")
    page.evaluate("""() => {
      for (let n = 1; n <= 60; n++) window.model.set('figure', window.figureOf(n * 100));
    }""")
    got = _wait_drawn(page, "figure 6000", 10_000)
    assert got["points"] == 6000 and got["draws"] < 10, json.dumps(got)
