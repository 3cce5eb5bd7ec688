"""A JupyterLab session in Chromium for the browser tests (tests/test_browser*.py): one notebook
copied into a fresh root, JupyterLab's DEFAULT settings (its windowing included: off-screen
cells are not rendered), a window of a person's size, the artifacts kept on failure."""

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

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts" / "browser"
# the screenshots linked from docs/jupyter.md are refreshed only when asked
# (SUPEROFFLOAD_UPDATE_DOC_IMAGES=1 make pytest); otherwise they go to artifacts/ with the rest
IMAGES = (REPO / "docs" / "img" if os.environ.get("SUPEROFFLOAD_UPDATE_DOC_IMAGES") == "1"
          else ARTIFACTS)
SCREEN = (1366, 768)
"""The window a person with a laptop has: every notebook is opened and run at this size."""
THROTTLE = 6.0
"""Chromium's CPU throttling (DevTools `Emulation.setCPUThrottlingRate`) while a notebook opens
and its live view draws its first data: a slow laptop, on top of whatever load the machine
has. The cache is off for the whole session (a cold start)."""
FIRST_DRAW_S = 10.0
"""A live view draws within this many seconds of its first data reaching it (the later of the
data's arrival in the page and the view's start: a dashboard shown in the notebook's last cell
starts after its data came)."""


def require_browser() -> None:
    if not Path(bs.CHROMIUM).exists():
        pytest.skip(f"{bs.CHROMIUM} is absent: install it with `apt-get install chromium` "
                    "(.ci/run does); the Playwright browser download is not used")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab (the notebooks extra)")


def iteration(status: str) -> int:
    match = re.search(r"iteration (\d+)", status)
    return int(match.group(1)) if match else -1


class Session:
    """JupyterLab on a copy of one notebook, chromium on it; artifacts kept on failure."""

    def __init__(self, pw: Any, url: str, name: str, viewport: tuple[int, int] = SCREEN) -> None:
        self.name = name
        self.browser = pw.chromium.launch(executable_path=bs.CHROMIUM, args=bs.CHROMIUM_ARGS,
                                          timeout=60_000)
        self.page = self.browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        self.page.set_default_timeout(120_000)
        self.url = url
        self.t0 = time.monotonic()
        self.cdp = self.page.context.new_cdp_session(self.page)
        self.cdp.send("Network.enable")
        self.cdp.send("Network.setCacheDisabled", {"cacheDisabled": True})
        self.throttle(THROTTLE)

    def throttle(self, rate: float) -> None:
        """Slow the page's CPU down `rate` times (1: full speed)."""
        self.cdp.send("Emulation.setCPUThrottlingRate", {"rate": rate})
        self.rate = rate

    def first_draw(self, timeout_s: float = 300.0,
                   limit_s: float | None = FIRST_DRAW_S) -> dict[str, Any]:
        """Wait for the live view's first drawn figure with data, keeping the view on screen
        (a view off screen waits, by design); check it was drawn within `FIRST_DRAW_S` of that
        data reaching the page (under `THROTTLE`; `limit_s` None: a notebook that starts its
        run in the cell that shows the dashboard, where plotly.js has no time to load
        beforehand, is only timed); then full speed for the rest of the test (the other checks
        are about behaviour, not a slow page)."""
        self.page.evaluate(bs.JS_WATCH_DASHBOARD)  # a person watching it: in view
        d = self.wait(lambda d: d["dataToDrawMs"] is not None, timeout_s=timeout_s, live=False)
        # where the time went, in seconds from the data's arrival (liveplot.js's timeline)
        arrived = max(d["firstDataMs"], d["renderedMs"])
        steps = sorted((d["timeline"] or {}).items(), key=lambda step: step[1])
        went = ", ".join(f"{step} {(ms - arrived) / 1e3:+.1f} s" for step, ms in steps)
        if d["plotlyMs"]:
            started, ready = d["plotlyMs"]
            went += (f"; plotly.js evaluated in {(ready - started) / 1e3:.1f} s, ready "
                     f"{(ready - arrived) / 1e3:+.1f} s")
        self.phase(f"first data drawn {d['dataToDrawMs'] / 1e3:.1f} s after it reached the view "
                   f"(CPU throttled {self.rate:g}x, cache off; from then: {went})")
        assert limit_s is None or d["dataToDrawMs"] <= limit_s * 1e3, (
            f"the live view drew its first data {d['dataToDrawMs'] / 1e3:.1f} s after it arrived "
            f"(at most {limit_s} s; from then: {went}): {d}")
        self.throttle(1.0)
        return d

    def phase(self, what: str) -> None:  # where the time goes, shown with `pytest -s`
        print(f"[browser test] {time.monotonic() - self.t0:6.1f} s  {what}", flush=True)

    def open(self, notebook: str) -> None:
        self.page.goto(f"{self.url}/lab/tree/{notebook}")
        self.page.wait_for_function(bs.JS_APP_READY)

    def reload(self) -> None:
        """Reload the page; wait until the notebook is back (its kernel may be gone)."""
        self.page.reload()
        self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell"
                                    ".currentWidget && window.jupyterapp.shell.currentWidget"
                                    ".content")

    def dashboard(self) -> dict[str, Any]:
        return dict(self.page.evaluate(bs.JS_DASHBOARD))

    def wait(self, ok: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0, *,
             live: bool = True) -> dict[str, Any]:
        """Read the dashboard until `ok(state)` holds (it refreshes a few times a second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            d = self.dashboard()
            if (d["live"] or not live) and ok(d):
                return d
            if time.monotonic() > deadline:
                raise AssertionError(f"the dashboard never reached the expected state: {d}")
            self.page.wait_for_timeout(250)

    def screenshot(self, selector: str, path: Path) -> None:
        """The whole element: a viewport tall enough that JupyterLab does not clip it."""
        page = self.page
        size = page.viewport_size or {"width": SCREEN[0], "height": SCREEN[1]}
        box = page.locator(selector).bounding_box()
        page.set_viewport_size({"width": 1400, "height": max(1000, int(box["height"]) + 300)})
        page.locator(selector).scroll_into_view_if_needed()
        page.wait_for_timeout(800)  # the figure follows the resize
        page.locator(selector).screenshot(path=str(path))
        page.set_viewport_size(size)

    def fail_artifacts(self) -> None:
        self.page.screenshot(path=str(ARTIFACTS / f"{self.name}_failure.png"), full_page=True)
        print("cell errors / stderr:", *self.page.evaluate(bs.JS_CELL_ERRORS), sep="\n")

    def close(self) -> None:
        self.browser.close()


def run_notebook(tmp_path: Path, notebook: Path, name: str, check: Callable[[Session], None], *,
                 parameters: dict[str, Any] | None = None,
                 prepare: Callable[[Path], None] | None = None) -> None:
    """Copy `notebook` (its "parameters" cell given `parameters`) into a fresh root (`prepare`
    may add files there), open it in JupyterLab with its default settings, run `check`."""
    require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "root"
    root.mkdir()
    bs.prepare_notebook(notebook, root / notebook.name, parameters=parameters)
    if prepare is not None:
        prepare(root)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    with bs.jupyter_lab(root) as url, sync_playwright() as pw:
        s = Session(pw, url, name)
        try:
            s.open(notebook.name)
            s.phase("notebook open, kernel connected")
            try:
                check(s)
                s.phase("checks passed")
            except BaseException:
                s.fail_artifacts()
                raise
            finally:
                # never leave the kernel training: press Stop if a check failed before it
                stop = s.page.locator(".so-trainer-stop")
                if stop.count() and stop.first.is_enabled():
                    stop.first.click()
        finally:
            s.close()
    if (tmp_path / "jupyter.log").exists():
        shutil.copy(tmp_path / "jupyter.log", ARTIFACTS / f"{name}_jupyter.log")


def lands_on(s: Session, selector: str) -> dict[str, Any]:
    """Where Run All left the view: `selector`'s box against the notebook's visible area; it
    must fit that area and be inside it (a person sees all of it without scrolling)."""
    where = s.page.evaluate(bs.JS_ON_SCREEN, selector)
    assert where is not None, f"{selector} is not on the page"
    assert where["height"] <= where["viewHeight"], (
        f"{selector} is {where['height']:.0f} px tall, the notebook shows "
        f"{where['viewHeight']:.0f} px")
    assert where["inside"], f"Run All left {selector} partly out of view: {where}"
    return where


def one_tuner(s: Session, *, frozen: bool) -> None:
    """One tuner on the page: its live controls while the run goes (no static copy beside
    them), one static snapshot in their place after it."""
    page = s.page
    text = page.evaluate(bs.JS_OUTPUT_TEXT)
    if frozen:
        assert page.locator(".so-tuner").count() == 0, "the live tuner was replaced"
        assert page.locator(".so-tuner-snapshot").count() == 1, "one tuner snapshot"
        assert text.count("offload tuner (static snapshot)") == 1, "one tuner snapshot"
    else:
        assert page.locator(".so-tuner").count() == 1, "one live tuner"
        assert page.locator(".so-tuner-snapshot").count() == 0, "no static copy of it meanwhile"
        assert "offload tuner (static snapshot)" not in text, "no static copy of it meanwhile"
