"""End to end in a real browser: JupyterLab + Debian's chromium driven by Playwright.

Opens the quick-start tutorial, runs every cell (training keeps going in its background
thread), then checks in the page itself that
  1. the dashboard renders, and its timeline and bandwidth traces grow while training runs;
  2. moving the tuner's ratio slider and pressing "Apply to engine" changes the engine's ratio
     on a later iteration (the dashboard title reports the engine's per-iteration "ratio"
     scalar and the iteration since which it holds).
Screenshots land in artifacts/browser/ (git-ignored). Budget: well under 3 minutes.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from tests import browser_support as bs

# One retry: an end-to-end run through JupyterLab and chromium on a loaded 2-core machine can
# lose a render race that has nothing to do with our code; a real defect fails twice (the
# failing attempt's screenshot and JupyterLab log are kept in artifacts/browser/).
pytestmark = [pytest.mark.browser, pytest.mark.timeout(300), pytest.mark.flaky(reruns=1)]

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "tutorials" / "01_quick_start.ipynb"
ARTIFACTS = REPO / "artifacts" / "browser"
D2H_TRACE = "D2H GB/s (bytes / iteration time)"
COMPUTE_TRACE = "device compute"


def _require_browser() -> None:
    if not Path(bs.CHROMIUM).exists():
        pytest.skip(f"{bs.CHROMIUM} is absent: install it with `apt-get install chromium` "
                    "(.ci/run does); the Playwright browser download is not used")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab (the notebooks extra)")


def _trace(plot: dict, name: str) -> tuple[int, float | None]:
    k = plot["names"].index(name)
    return plot["lengths"][k], plot["lastX"][k]


def _title_iteration(title: str) -> int:
    match = re.search(r"iteration (\d+)", title)
    assert match, f"no iteration in the dashboard title {title!r}"
    return int(match.group(1))


def test_quick_start_dashboard_and_tuner_in_chromium(tmp_path: Path) -> None:
    _require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "root"
    root.mkdir()
    # STEPS high: the run must still be going while the browser watches; the cells tagged
    # "final-check" (which wait for the end of training) are left out of this copy.
    bs.prepare_notebook(NOTEBOOK, root / NOTEBOOK.name, parameters={"STEPS": 1_000_000})
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def phase(name: str) -> None:  # where the time goes, shown with `pytest -s`
        print(f"[browser test] {time.monotonic() - t0:6.1f} s  {name}")

    with bs.jupyter_lab(root) as url, sync_playwright() as pw:
        phase("jupyter lab up")
        browser = pw.chromium.launch(executable_path=bs.CHROMIUM, args=bs.CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            page.set_default_timeout(90_000)
            page.goto(f"{url}/lab/tree/{NOTEBOOK.name}")
            page.wait_for_function(bs.JS_APP_READY)
            phase("notebook open, kernel connected")
            page.evaluate(bs.JS_RUN_ALL)
            phase("all cells ran")
            try:
                page.wait_for_selector(".js-plotly-plot")
                page.wait_for_selector(".so-tuner-apply")
                phase("dashboard and tuner rendered")
                _check_live(page, phase)
                phase("checks passed")
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "quick_start_failure.png"))
                errors = page.evaluate(bs.JS_CELL_ERRORS)
                print("cell errors / stderr:", *errors, sep="\n")
                raise
        finally:
            browser.close()
    if (tmp_path / "jupyter.log").exists():
        shutil.copy(tmp_path / "jupyter.log", ARTIFACTS / "jupyter.log")


def _check_live(page, phase) -> None:  # type: ignore[no-untyped-def]
    # 1. the traces grow while the background thread trains
    first = _wait_plot(page, lambda p: _trace(p, D2H_TRACE)[0] >= 2)
    time.sleep(2.0)  # let training advance: we compare two moments of a live run
    second = _wait_plot(page, lambda p: _trace(p, D2H_TRACE)[0] > _trace(first, D2H_TRACE)[0])
    n1, t1 = _trace(first, COMPUTE_TRACE)
    n2, t2 = _trace(second, COMPUTE_TRACE)
    assert n1 > 0 and n2 > 0, "the timeline draws device-compute spans"
    assert t2 > t1, f"the timeline advances in time ({t1} -> {t2} s)"
    assert _title_iteration(second["title"]) > _title_iteration(first["title"])
    assert "ratio 0.50" in second["title"], second["title"]
    phase("traces grew")
    page.locator(".js-plotly-plot").first.screenshot(path=str(ARTIFACTS / "quick_start_dashboard.png"))
    phase("dashboard screenshot")

    # 2. the slider moves (keyboard on its handle, as a user would), apply reconfigures
    handle = page.locator(".so-tuner-ratio .noUi-handle")
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(6):  # step 0.05: 0.50 -> 0.80
        handle.press("ArrowRight")
    phase("slider moved")
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-ratio .widget-readout').textContent.trim() === '0.80'"
    )
    # the kernel got the last value and re-ran the planner (the front-end batches slider
    # updates while the kernel is busy, and a click is sent at once: wait before clicking)
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-prediction').textContent.includes('ratio 0.80,')"
    )
    before = _title_iteration(_plots(page)[0]["title"])
    page.click(".so-tuner-apply")
    phase("slider at 0.80 in the kernel")
    page.wait_for_function(
        "() => document.querySelector('.so-tuner-status').textContent.includes('applied ratio=0.8')"
    )
    phase("applied")
    after = _wait_plot(page, lambda p: "ratio 0.80 (since it." in p["title"], timeout_s=60)
    since = int(re.search(r"ratio 0\.80 \(since it\. (\d+)\)", after["title"]).group(1))  # type: ignore[union-attr]
    assert since > before, f"the new ratio holds from iteration {since}, after {before}"
    page.screenshot(path=str(ARTIFACTS / "quick_start_page.png"))


def _plots(page) -> list[dict]:  # type: ignore[no-untyped-def]
    return page.evaluate(bs.JS_PLOTS)


def _wait_plot(page, ok, timeout_s: float = 60.0) -> dict:  # type: ignore[no-untyped-def]
    """Read the dashboard's plotly data until `ok(plot)` holds (the page updates ~4 Hz)."""
    deadline = time.monotonic() + timeout_s
    while True:
        plots = [p for p in _plots(page) if D2H_TRACE in p["names"]]
        if plots and ok(plots[0]):
            return plots[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"dashboard never reached the expected state: {plots[:1]}")
        page.wait_for_timeout(250)
