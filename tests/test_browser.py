"""End to end in a real browser: JupyterLab + Debian's chromium driven by Playwright.

Runs the quick-start tutorial as a person would (Run All, the notebook unchanged, its live
path), then checks in the page itself that
  1. the tuner is shown before the dashboard, and the dashboard updates at least 10 times
     while training runs;
  2. moving the tuner's ratio slider (keyboard) and pressing "Apply to engine" changes the
     engine's ratio on a later iteration (the status line reports the engine's own
     per-iteration "ratio" scalar) and puts a reconfigure marker on the charts;
  3. "Stop training" stops the run: the trainer and the dashboard say "stopped", and the live
     figure is replaced by a static one of the last state;
  4. no figure is wider than its output area, no legend, axis title, tick label or
     annotation is clipped, no tuner label is cut, and no output shows a widget error.
Screenshots of the dashboard while training and of the tuner after Apply are written to
docs/img/ (linked from docs/jupyter.md); a failure leaves artifacts/browser/.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import browser_support as bs

# One retry: an end-to-end run through JupyterLab and chromium on a loaded 2-core machine can
# lose a render race that has nothing to do with our code; a real defect fails twice (the
# failing attempt's screenshot and JupyterLab log are kept in artifacts/browser/).
pytestmark = [pytest.mark.browser, pytest.mark.timeout(420), pytest.mark.flaky(reruns=1)]

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "tutorials" / "01_quick_start.ipynb"
ARTIFACTS = REPO / "artifacts" / "browser"
# the screenshots linked from docs/jupyter.md are refreshed only when asked
# (SUPEROFFLOAD_UPDATE_DOC_IMAGES=1 make pytest); otherwise they go to artifacts/ with the rest
IMAGES = (REPO / "docs" / "img" if os.environ.get("SUPEROFFLOAD_UPDATE_DOC_IMAGES") == "1"
          else ARTIFACTS)
MIN_UPDATES = 10


def _require_browser() -> None:
    if not Path(bs.CHROMIUM).exists():
        pytest.skip(f"{bs.CHROMIUM} is absent: install it with `apt-get install chromium` "
                    "(.ci/run does); the Playwright browser download is not used")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab (the notebooks extra)")


def _iteration(status: str) -> int:
    match = re.search(r"iteration (\d+)", status)
    return int(match.group(1)) if match else -1


def test_quick_start_live_dashboard_and_tuner_in_chromium(tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "root"
    root.mkdir()
    bs.prepare_notebook(NOTEBOOK, root / NOTEBOOK.name)  # unchanged: what a person opens
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def phase(name: str) -> None:  # where the time goes, shown with `pytest -s`
        print(f"[browser test] {time.monotonic() - t0:6.1f} s  {name}")

    with bs.jupyter_lab(root) as url, sync_playwright() as pw:
        phase("jupyter lab up")
        browser = pw.chromium.launch(executable_path=bs.CHROMIUM, args=bs.CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{url}/lab/tree/{NOTEBOOK.name}")
            page.wait_for_function(bs.JS_APP_READY)
            phase("notebook open, kernel connected")
            page.evaluate(bs.JS_RUN_ALL)
            phase("Run All returned (training goes on in its thread)")
            try:
                _check(page, phase)
                phase("checks passed")
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "quick_start_failure.png"), full_page=True)
                print("cell errors / stderr:", *page.evaluate(bs.JS_CELL_ERRORS), sep="\n")
                raise
            finally:
                # never leave the kernel training: press Stop if a check failed before it
                stop = page.locator(".so-trainer-stop")
                if stop.count() and stop.first.is_enabled():
                    stop.first.click()
        finally:
            browser.close()
    if (tmp_path / "jupyter.log").exists():
        shutil.copy(tmp_path / "jupyter.log", ARTIFACTS / "jupyter.log")


def _check(page: Any, phase: Callable[[str], None]) -> None:
    page.wait_for_selector(".so-tuner-apply")
    page.wait_for_selector(".so-dashboard .js-plotly-plot")
    order = page.evaluate("""() => {
      const t = document.querySelector('.so-tuner'), d = document.querySelector('.so-dashboard');
      return t.compareDocumentPosition(d) & Node.DOCUMENT_POSITION_FOLLOWING ? 'tuner first' : 'dashboard first';
    }""")
    assert order == "tuner first", "the tuner is shown before training starts"
    assert page.locator(".so-tuner-ratio .widget-readout").inner_text().strip() == "0.50", \
        "Run All leaves the ratio slider where the engine's config put it"
    phase("tuner and dashboard rendered")

    # 1. live: the figure is redrawn with new iterations while the trainer says "running"
    first = page.evaluate(bs.JS_DASHBOARD)
    states: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 150
    while len(states) < MIN_UPDATES:
        d = page.evaluate(bs.JS_DASHBOARD)
        assert "running" in d["trainer"], f"training must still run while we watch: {d['trainer']!r}"
        if d["measured"] and d["measured"]["n"]:
            states.add((_iteration(d["status"]), d["measured"]["n"]))
        assert time.monotonic() < deadline, f"only {len(states)} dashboard updates seen: {d}"
        page.wait_for_timeout(300)
    d = page.evaluate(bs.JS_DASHBOARD)
    assert d["draws"] - first["draws"] >= MIN_UPDATES - 1, (first["draws"], d["draws"])
    assert d["compute"]["n"] > 0, "the timeline draws device-compute spans"
    assert "ratio 0.50" in d["status"], d["status"]
    phase(f"{len(states)} distinct dashboard states while training ({d['draws']} figures drawn, "
          f"the last in {d['drawMs']} ms)")
    _screenshot(page, ".so-dashboard", IMAGES / "quick_start_dashboard.png")

    # 2. move the slider with the keyboard, as a user would; apply
    handle = page.locator(".so-tuner-ratio .noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(6):  # step 0.05: 0.50 -> 0.80
        handle.press("ArrowRight")
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-ratio .widget-readout').textContent.trim() === '0.80'")
    phase("slider moved in the page")
    # the kernel got the last value and re-ran the planner (debounced, off the UI thread)
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-prediction').textContent.includes('ratio 0.80,')")
    page.wait_for_function("() => !document.querySelector('.so-tuner-apply').disabled")
    phase("slider at 0.80 in the kernel, Apply enabled")
    before = _iteration(page.evaluate(bs.JS_DASHBOARD)["status"])
    page.click(".so-tuner-apply")
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-status').textContent.includes('applied ratio=0.8')")
    phase("applied")
    after = _wait(page, lambda d: "ratio 0.80 (since it." in d["status"]
                  and any("ratio 0.5→0.8" in a for a in d["annotations"]), timeout_s=90)
    since = int(re.search(r"ratio 0\.80 \(since it\. (\d+)\)", after["status"]).group(1))  # type: ignore[union-attr]
    assert since > before, f"the new ratio holds from iteration {since}, after {before}"
    assert any(s["xref"] == "x2" and int(s["x0"]) == since for s in after["shapes"]), after["shapes"]
    phase("the engine's ratio changed; the marker is on the charts")
    _screenshot(page, ".so-tuner", IMAGES / "quick_start_tuner.png")

    problems = page.evaluate(bs.JS_LAYOUT_PROBLEMS)
    assert problems == [], "clipped or overflowing:\n" + "\n".join(problems)
    assert page.evaluate(bs.JS_WIDGET_ERRORS) == []

    # 3. stop: the states say so and the live figure becomes a static one
    page.click(".so-trainer-stop")
    page.wait_for_function(
        "() => document.querySelector('.so-trainer-status').textContent.includes('stopped')")
    page.wait_for_function("() => !document.querySelector('.so-dashboard')", timeout=60_000)
    static = _wait_static(page, lambda p: "stopped" in p["title"])
    assert static["traces"] > 0
    phase("stopped; the static figure replaced the live one")
    page.wait_for_timeout(500)
    problems = page.evaluate(bs.JS_LAYOUT_PROBLEMS)
    assert problems == [], "clipped or overflowing after the stop:\n" + "\n".join(problems)
    assert page.evaluate(bs.JS_WIDGET_ERRORS) == []
    assert "training stopped" in page.locator(".so-tuner-status").inner_text()


def _screenshot(page: Any, selector: str, path: Path) -> None:
    """The whole element: a viewport tall enough that JupyterLab does not clip it."""
    box = page.locator(selector).bounding_box()
    page.set_viewport_size({"width": 1400, "height": max(1000, int(box["height"]) + 300)})
    page.locator(selector).scroll_into_view_if_needed()
    page.wait_for_timeout(800)  # the figure follows the resize
    page.locator(selector).screenshot(path=str(path))
    page.set_viewport_size({"width": 1400, "height": 1000})


def _wait(page: Any, ok: Callable[[dict], bool], timeout_s: float = 60.0) -> dict:
    """Read the live dashboard until `ok(state)` holds (it refreshes a few times a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = page.evaluate(bs.JS_DASHBOARD)
        if d["live"] and ok(d):
            return d
        if time.monotonic() > deadline:
            raise AssertionError(f"dashboard never reached the expected state: {d}")
        page.wait_for_timeout(250)


def _wait_static(page: Any, ok: Callable[[dict], bool], timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        plots = [p for p in page.evaluate(bs.JS_STATIC_PLOTS) if ok(p)]
        if plots:
            return plots[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no static figure of the stopped run: {page.evaluate(bs.JS_STATIC_PLOTS)}")
        page.wait_for_timeout(250)
