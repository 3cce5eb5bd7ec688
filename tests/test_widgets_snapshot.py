"""A saved notebook keeps every view's last state: the trainer's progress
line, its live status line, the tuner and the dashboard are each shown in a rewritable output
and replaced IN PLACE by a static snapshot when the run ends, and by the kernel's exit hook
when it is still live. Checked against a fake kernel that records display messages."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from superoffload import plan
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.runstate import RunState
from superoffload.widgets.shared.trainer import BackgroundTrainer
from superoffload.widgets.tuner.tuner import OffloadTuner
from tests.widgets_support import FakeEngine, record_iteration

SHAPE = plan.ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=32, micro_batch=4)


class Outputs:
    """What a front-end would hold: display id -> the newest bundle shown there."""

    def __init__(self) -> None:
        self.by_id: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def display(self, bundle: Any, raw: bool = False, display_id: str | None = None,
                **_: Any) -> None:
        assert raw and display_id, "every view is shown in a rewritable output"
        with self.lock:
            self.by_id[display_id] = bundle

    def update_display(self, bundle: Any, raw: bool = False, display_id: str | None = None,
                       **_: Any) -> None:
        with self.lock:
            assert display_id in self.by_id, "an update rewrites an output shown before"
            self.by_id[display_id] = bundle

    def live(self) -> list[str]:
        """Outputs that still need a kernel (a widget view): 'model not found' if reopened."""
        return [k for k, b in self.by_id.items() if snap.WIDGET_MIME in b]

    def text(self) -> str:
        return "\n".join(b.get("text/plain", "") for b in self.by_id.values())


@pytest.fixture
def outputs(monkeypatch: pytest.MonkeyPatch) -> Outputs:
    pytest.importorskip("ipywidgets")
    import IPython.display

    out = Outputs()
    monkeypatch.setattr(IPython.display, "display", out.display)
    monkeypatch.setattr(IPython.display, "update_display", out.update_display)
    monkeypatch.setattr(_env, "in_notebook", lambda: True)
    return out


def test_at_the_end_of_a_run_every_live_view_becomes_its_static_snapshot(outputs: Outputs) -> None:
    engine = FakeEngine()
    t = 0.0
    for it in range(6):
        t = record_iteration(engine.telemetry, it, t, loss=4.0 - 0.1 * it) + 0.001
    engine.iteration = 6
    tuner = OffloadTuner(SHAPE, "gh200", engine=engine, debounce_s=0, measure_apply=False,
                         calibrate_after=None)
    dash = LiveDashboard(engine, shape=SHAPE, profile="gh200", live=True, calibrate_after=None)
    release = threading.Event()

    def step(i: int) -> float:
        release.wait(30)
        return 2.0

    trainer = BackgroundTrainer(step, steps=3, dashboard=dash, tuner=tuner)
    tuner.display()
    dash.display()
    trainer._ipython_display_()
    trainer.show_status()  # the check cell's live status line (item 6)
    assert len(outputs.live()) == 4, "tuner, dashboard, progress line, status line: live"
    assert len(outputs.by_id) == 4, "one output per view: no static copy beside a live one"
    trainer.start()
    release.set()
    result = trainer.wait(timeout_s=30)
    assert result.state is RunState.FINISHED
    assert outputs.live() == [], "nothing in the saved notebook needs the kernel"
    text = outputs.text()
    assert "superoffload-train: finished, step 3 of 3" in text and "loss 2.0000" in text
    assert text.count("offload tuner (static snapshot)") == 1, "one tuner, replaced in place"
    assert sum(snap.PLOTLY_MIME in b for b in outputs.by_id.values()) == 1, "one dashboard figure"
    assert len(outputs.by_id) == 4, "each view's output replaced in place, none added"


def test_views_still_live_when_the_kernel_exits_are_frozen_by_the_exit_hook(
        outputs: Outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    hooks: list[Any] = []
    monkeypatch.setattr(snap.atexit, "register", hooks.append)
    monkeypatch.setattr(snap, "_hooked", False)
    monkeypatch.setattr(snap, "exiting", False)
    engine = FakeEngine()
    record_iteration(engine.telemetry, 0, 0.0, loss=4.0)
    dash = LiveDashboard(engine, shape=SHAPE, profile="gh200", live=True, calibrate_after=None)
    trainer = BackgroundTrainer(lambda i: 1.0, steps=5)
    dash.display()
    trainer._ipython_display_()
    assert hooks == [snap.freeze_all], "the exit hook is registered with the first live view"
    assert len(outputs.live()) == 2
    assert hooks[0]() >= 2, "what the kernel's exit runs"
    assert outputs.live() == []
    assert "superoffload-train: not started" in outputs.text() and snap.EXIT_NOTE in outputs.text()


class _Kernel:
    """ipykernel's side of a shutdown request: `do_shutdown` runs before the reply."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self.calls.append(f"do_shutdown(restart={restart})")
        return {"status": "ok", "restart": restart}


def test_a_shutdown_request_freezes_the_live_views_before_the_kernel_replies(
        outputs: Outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The front-end's shutdown (or restart) runs the freeze before ipykernel replies: after
    the reply the server may drop output the exit hook sends later."""
    kernel = _Kernel()
    monkeypatch.setattr(_env, "_get_ipython", lambda: type("IP", (), {"kernel": kernel})())
    monkeypatch.setattr(snap.atexit, "register", lambda fn: None)
    monkeypatch.setattr(snap, "_hooked", False)
    monkeypatch.setattr(snap, "exiting", False)
    trainer = BackgroundTrainer(lambda i: 1.0, steps=5)
    trainer._ipython_display_()
    assert len(outputs.live()) == 1
    seen = []
    _env.on_kernel_shutdown(lambda: seen.append(len(outputs.live())))  # sees the freeze done
    _env.on_kernel_shutdown(lambda: 1 / 0)  # a failing hook does not stop the shutdown
    assert kernel.do_shutdown(True) == {"status": "ok", "restart": True}
    assert kernel.calls == ["do_shutdown(restart=True)"]
    assert seen == [0] and outputs.live() == [] and snap.EXIT_NOTE in outputs.text()
    _env.on_kernel_shutdown(snap.freeze_all)  # hooked once per function
    kernel.do_shutdown(False)
    assert seen == [0, 0] and kernel.calls[-1] == "do_shutdown(restart=False)"


def test_a_placeholder_holds_the_place_until_its_view_appears(outputs: Outputs) -> None:
    slot = snap.placeholder("measuring this machine ...")
    assert outputs.by_id[slot.display_id]["text/plain"] == "measuring this machine ..."
    slot.clear()
    assert outputs.by_id[slot.display_id] == {"text/plain": ""}


def test_a_warning_line_is_coloured_and_the_rest_escaped() -> None:
    html = snap.html_lines(["title", "warning: <b>slow</b>", "a < b"])
    assert "<span class='so-warning'" in html and "&lt;b&gt;slow" in html and "a &lt; b" in html
