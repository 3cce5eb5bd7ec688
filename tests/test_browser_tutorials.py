"""Tutorials 08 and 07 in a real browser, as a person runs them: JupyterLab's DEFAULT settings
(off-screen cells are not rendered), a 1366x768 window, Run All.

Both open with Chromium's CPU throttled 6x and the cache off, and their live figure must draw
within 10 s of its first data (tests/browser_session.py, `first_draw`).

1. Tutorial 08 (`trainer.train()` holds its cell): the dashboard draws its first data; then,
   scrolled away, it waits without drawing while newer data arrives, draws the newest figure
   as soon as it is scrolled back into view, and keeps redrawing while the cell trains (the
   live figure used to stay empty for the whole run: one draw started off screen never
   finished and blocked all later ones).
2. Tutorial 07: Run All ends on live views, not on text frozen at the first steps: the "what
   calibration changed" section fills in by itself once the planner has calibrated, the
   trainer's status line keeps counting, and the dashboard (the last cell) draws the run; one
   tuner during the run, one snapshot of it (and of the calibration) after Stop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import browser_support as bs
from tests.browser_session import (
    REPO,
    Session,
    iteration,
    one_tuner,
    run_notebook,
)

pytestmark = [pytest.mark.browser, pytest.mark.flaky(reruns=1)]

TUTORIAL_07 = REPO / "tutorials" / "07_tuning_for_your_machine.ipynb"
TUTORIAL_08 = REPO / "tutorials" / "08_hf_trainer_and_fit.ipynb"


# Each optimizer step of tutorial 08 lasts at least this long in the browser test, as a real
# model's step does: the toy model's 320 steps took 20-70 s depending on the machine's load,
# and on a quiet machine the run ended (its dashboard frozen into a static figure) before the
# checks below had scrolled away and back; paced, the run outlasts them on any machine.
STEP_PACE_S = 0.25
PACE_SOURCE = f"""# set by tests/test_browser_tutorials.py: each optimizer step lasts at least
# {STEP_PACE_S} s, as a larger model's does (the checks need the run to outlast them)
import time as _time

from transformers import TrainerCallback


class _Pace(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.started = _time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        _time.sleep(max(0.0, {STEP_PACE_S} - (_time.monotonic() - self.started)))


trainer.add_callback(_Pace())
"""


def _pace_training(root: Path) -> None:
    """Insert PACE_SOURCE after the cell that builds the tutorial's `trainer`."""
    path = root / TUTORIAL_08.name
    nb = json.loads(path.read_text())
    builds = [i for i, c in enumerate(nb["cells"])
              if "trainer = SuperOffloadTrainer(" in "".join(c["source"])]
    at = builds[0]
    cell = {"cell_type": "code", "execution_count": None, "id": "browser-test-pace",
            "metadata": {}, "outputs": [], "source": PACE_SOURCE.splitlines(keepends=True)}
    nb["cells"].insert(at + 1, cell)
    path.write_text(json.dumps(nb, indent=1))


@pytest.mark.timeout(900)
def test_tutorial_08_draws_the_newest_figure_whenever_it_comes_into_view(tmp_path) -> None:
    run_notebook(tmp_path, TUTORIAL_08, "tutorial_08", _tutorial_08, parameters={"STEPS": 480},
                 prepare=_pace_training)


def _train_cell(s: Session) -> int:
    """The index of the cell that calls trainer.train()."""
    return int(s.page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
        .findIndex(c => c.model.type === 'code'
                        && c.model.sharedModel.getSource().includes('trainer.train()'))"""))


def _tutorial_08(s: Session) -> None:
    page = s.page
    page.evaluate(bs.JS_START_RUN_ALL)
    s.phase("Run All started")
    train_cell = _train_cell(s)
    page.wait_for_selector(".so-dashboard", state="attached", timeout=300_000)
    s.first_draw()
    # away from the dashboard, as a person reading the tutorial's top is, while training goes on
    page.evaluate(bs.JS_SCROLL_TO_TOP)
    at = iteration(s.dashboard()["status"])
    hidden = s.wait(lambda d: d["pending"] == "hidden" and iteration(d["status"]) >= at + 5,
                    timeout_s=300, live=False)
    draws_hidden = hidden["draws"]
    page.wait_for_timeout(3000)
    d = s.dashboard()
    assert d["draws"] == draws_hidden and d["pending"] == "hidden", \
        f"off screen, figures wait for the view instead of being drawn: {d}"
    s.phase(f"off screen at iteration {iteration(d['status'])}: {d['draws']} draws, newer "
            "figures waiting")
    page.locator(".so-dashboard").scroll_into_view_if_needed()
    shown = s.wait(lambda d: d["draws"] > draws_hidden and (d["measured"] or {}).get("n", 0) > 0
                   and d["pending"] == "", timeout_s=30)
    s.phase(f"scrolled into view: drawn within seconds ({shown['measured']['n']} iterations, "
            f"the draw took {shown['drawMs']} ms)")
    draws: set[int] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        d = s.dashboard()
        if not d["live"]:
            break
        if "running" in d["status"] and page.evaluate(bs.JS_CELL_RUNNING, train_cell):
            draws.add(d["draws"])
        if len(draws) >= 8:
            break
        page.wait_for_timeout(400)
    assert len(draws) >= 5, f"the dashboard redrew only {len(draws)} times during trainer.train()"
    assert s.dashboard()["stalls"] == 0, "no draw had to be abandoned on a visible figure"
    s.phase(f"{len(draws)} different draw counts while trainer.train() ran")
    page.wait_for_function(f"() => ({bs.JS_OUTPUT_TEXT})().includes('held-out loss')",
                           timeout=600_000)


@pytest.mark.timeout(900)
def test_tutorial_07_run_all_ends_on_live_views(tmp_path) -> None:
    run_notebook(tmp_path, TUTORIAL_07, "tutorial_07", _tutorial_07, parameters={"MINUTES": 6})


CALIBRATED = "planner calibrated on iterations"


def _tutorial_07(s: Session) -> None:
    page = s.page
    page.evaluate(bs.JS_START_RUN_ALL)
    page.wait_for_selector(".so-dashboard", state="attached", timeout=300_000)
    s.first_draw()
    s.wait(lambda d: (d["measured"] or {}).get("n", 0) > 0, timeout_s=300)
    one_tuner(s, frozen=False)
    view = page.locator(".so-calibration")
    assert view.count() == 1, "the 'what calibration changed' section has a live view"
    page.wait_for_function("() => document.querySelector('.so-calibration')"
                           f".textContent.includes('{CALIBRATED}')",
                           timeout=300_000)
    text = view.text_content() or ""
    assert "before: predicted" in text and "after:" in text, text
    s.phase("the calibration section filled in by itself: " + text[:120])
    first = s.dashboard()
    later = s.wait(lambda d: iteration(d["status"]) > iteration(first["status"]) + 2,
                   timeout_s=120)
    assert "running" in later["trainer"], "the run's status keeps counting after Run All"
    page.click(".so-trainer-stop")
    page.wait_for_function(f"() => ({bs.JS_OUTPUT_TEXT})().includes('superoffload-train: stopped')",
                           timeout=180_000)
    page.wait_for_function(
        "() => !document.querySelector('.so-dashboard, .so-tuner, .so-calibration')",
                           timeout=180_000)
    one_tuner(s, frozen=True)
    snapshot = page.locator(".so-calibration-snapshot")
    assert snapshot.count() == 1 and CALIBRATED in (snapshot.text_content() or "")
    assert page.evaluate(bs.JS_WIDGET_ERRORS) == []
    s.phase("stopped: one tuner snapshot, the calibration kept, the dashboard frozen in place")
