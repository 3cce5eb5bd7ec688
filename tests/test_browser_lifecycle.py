"""How a live run ends, in a real browser (JupyterLab's default settings, Chromium throttled
as in tests/browser_session.py): every ending leaves a static figure, a run has one owner.

1. The live figure's widget model fails to initialize (its module is made to hang in the page,
   as a 4.8 MB module did on a busy page: anywidget gives up after 2 s): the dashboard falls
   back to a copy of the figure redrawn in place, and says so; Stop leaves the static figure.
2. The trainer cell is run again mid-run: the first run is stopped and the second one takes
   over (one training thread in the kernel, one Stop button). Then the kernel is restarted
   mid-run: the page freezes the live views itself (the front-end drops what the old kernel
   sends once a restart begins), the notebook is saved, reloaded, and shows the figure and
   the trainer's last line, no "model not found".
Fake training steps (a recorder filled as the engine would), so the checks are about the
views, not the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import browser_support as bs
from tests.browser_session import REPO, Session, run_notebook

pytestmark = [pytest.mark.browser, pytest.mark.flaky(reruns=1)]

SETUP = (f"import sys, time\nsys.path.insert(0, {str(REPO)!r})\n"
         "from superoffload.telemetry.recorder import Recorder\n"
         "from superoffload.widgets import BackgroundTrainer, LiveDashboard\n"
         "from tests.widgets_support import record_iteration\n"
         "rec, clock = Recorder(), [0.0, 0]\n"
         "def step(_i):  # the engine's iterations go on across runs, as an engine's do\n"
         "    clock[0] = record_iteration(rec, clock[1], clock[0], loss=3.0) + 0.001\n"
         "    clock[1] += 1\n"
         "    time.sleep(0.02)\n"
         "    return 3.0\n")
TRAIN = ("dash = LiveDashboard(rec)\n"
         "display(dash)\n"
         "trainer = BackgroundTrainer(step, dashboard=dash)\n"
         "display(trainer)\n"
         "trainer.start();")
HANG_THE_LIVE_FIGURE = """() => {
  // the live figure's module never finishes loading: anywidget fails its model after 2 s
  const Original = window.Blob;
  window.Blob = function (parts, options) {
    if (parts && parts.some(p => typeof p === 'string' && p.includes('so-liveplot-esm')))
      parts = ['await new Promise(() => {});\\n', ...parts];
    return new Original(parts, options);
  };
  window.Blob.prototype = Original.prototype;
}"""
TRAINING_THREADS = ("import threading\n"
                    "print(sum(t.name == 'superoffload-train' and t.is_alive() "
                    "for t in threading.enumerate()))")


def _notebook(path: Path, *cells: str) -> Path:
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{k}", "metadata": {},
                     "outputs": [], "source": src} for k, src in enumerate(cells)],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.timeout(420)
def test_a_live_figure_that_fails_to_start_falls_back_to_a_copy_redrawn_in_place(tmp_path) -> None:
    source = _notebook(tmp_path / "fallback.ipynb", SETUP, TRAIN)

    def check(s: Session) -> None:
        page = s.page
        page.evaluate(HANG_THE_LIVE_FIGURE)
        page.evaluate(bs.JS_RUN_ALL)
        s.throttle(1.0)  # the failure is forced: the fallback itself is what is checked here
        first = s.wait(lambda d: (d["fallback"] or {}).get("traces", 0) > 0
                       and "the live figure did not start in this browser" in d["status"],
                       timeout_s=120, live=False)
        assert first["draws"] == 0, "the live figure never drew: its model did not start"
        assert "did not start" in first["fallback"]["title"] and first["fallback"]["shown"]
        s.phase("the copy drew in place of the live figure, and the status says why")
        later = s.wait(lambda d: (d["fallback"] or {}).get("points", 0)
                       > first["fallback"]["points"], timeout_s=60, live=False)
        s.phase(f"redrawn in place: {first['fallback']['points']} -> "
                f"{later['fallback']['points']} points")
        page.click(".so-trainer-stop")
        page.wait_for_function("() => !document.querySelector('.so-dashboard')", timeout=60_000)
        page.wait_for_selector(".jp-RenderedPlotly", state="attached", timeout=60_000)
        assert page.evaluate(bs.JS_WIDGET_ERRORS) == []

    run_notebook(tmp_path, source, "fallback", check)


@pytest.mark.timeout(420)
def test_a_rerun_cell_takes_the_run_over_and_a_restart_leaves_static_outputs(tmp_path) -> None:
    source = _notebook(tmp_path / "lifecycle.ipynb", SETUP, TRAIN)

    def check(s: Session) -> None:
        page = s.page
        page.evaluate(bs.JS_RUN_ALL)
        s.first_draw(limit_s=None)  # the cell that shows the dashboard starts the run
        s.wait(lambda d: d["draws"] >= 2, timeout_s=60)
        # the training cell again, mid-run (what a person does to "restart training")
        page.evaluate(bs.JS_RUN_CELL, 1)
        page.wait_for_function(f"() => ({bs.JS_OUTPUT_TEXT})().includes('one run per engine')",
                               timeout=60_000)
        threads = page.evaluate(bs.JS_EXECUTE, TRAINING_THREADS).strip()
        assert threads == "1", f"one run trains the recorder, not {threads}"
        assert page.locator(".so-trainer-stop").count() == 1, "one Stop button"
        s.wait(lambda d: d["draws"] >= 1 and "running" in d["trainer"], timeout_s=60)
        s.phase("the re-run cell took the run over: one training thread, one Stop")
        page.evaluate(bs.JS_RESTART_KERNEL)
        page.wait_for_function("() => !document.querySelector('.so-dashboard, .so-trainer')",
                               timeout=60_000)
        text = page.evaluate(bs.JS_OUTPUT_TEXT)
        assert "frozen here when the kernel restarted" in text, text[-600:]
        assert page.locator(".jp-RenderedPlotly").count() >= 1, "the figure, frozen by the page"
        s.phase("kernel restarted: the page froze every live view")
        page.evaluate(
            "async () => { await window.jupyterapp.commands.execute('docmanager:save'); }")
        s.reload()
        page.wait_for_selector(".jp-RenderedPlotly", state="attached", timeout=60_000)
        assert page.evaluate(bs.JS_WIDGET_ERRORS) == [], "the saved notebook reopens cleanly"
        assert "superoffload-train: running" in page.evaluate(bs.JS_OUTPUT_TEXT)

    run_notebook(tmp_path, source, "lifecycle", check)
