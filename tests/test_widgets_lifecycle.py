"""One owner per run and every ending leaves a static output: without a browser.

A second start on the same engine (a re-run cell) stops the first and takes over; the views
the new run shares are not told the run ended; a dashboard re-started on the same recorder
freezes the old one; the live figure falls back to a copy redrawn in place when its widget
never says it started; a run that ended while no page was open is sent again at shutdown.
"""

from __future__ import annotations

import threading
import types

import pytest

from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard import box as box_mod
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.shared import owners
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.runstate import RunState
from superoffload.widgets.shared.trainer import BackgroundTrainer
from tests.widgets_support import FakeEngine, record_iteration


def _stepper(rec: Recorder, gate: threading.Event | None = None):  # type: ignore[no-untyped-def]
    clock = [0.0]

    def step(i: int) -> float:
        if gate is not None:
            gate.wait(30)
        clock[0] = record_iteration(rec, i, clock[0], loss=3.0) + 0.001
        return 3.0

    return step


def test_a_second_start_on_the_same_engine_stops_the_first_and_takes_over(capsys) -> None:
    engine = FakeEngine()
    go_on = threading.Event()
    step = _stepper(engine.telemetry)
    step.engine = engine  # what engine_step_fn marks: the run's key
    held = _stepper(engine.telemetry, go_on)
    held.engine = engine
    tuner = types.SimpleNamespace(states=[], engine=engine)
    tuner.set_run_state = tuner.states.append
    first = BackgroundTrainer(step, tuner=tuner, name="first").start()
    first.wait_for_steps(3, timeout_s=30)
    second = BackgroundTrainer(held, steps=5, tuner=tuner, name="second").start()
    assert not first.running and first.state is RunState.STOPPED, "one run per engine"
    assert first.replaced_by is second and "replaced by a run started later" in first.status()
    assert "one run per engine: stopping the run started before" in capsys.readouterr().out
    assert BackgroundTrainer.training(engine) is second and second.running
    go_on.set()
    second.wait(timeout_s=30)
    # the shared tuner never heard that the first run ended: it follows the second one
    assert tuner.states == [RunState.RUNNING, RunState.RUNNING, RunState.FINISHED]
    assert BackgroundTrainer.training(engine) is None, "a finished run lets go of the engine"


def test_runs_on_different_engines_do_not_touch_each_other() -> None:
    gate = threading.Event()
    a, b = FakeEngine(), FakeEngine()
    step_a, step_b = _stepper(a.telemetry, gate), _stepper(b.telemetry, gate)
    step_a.engine, step_b.engine = a, b
    ta = BackgroundTrainer(step_a, steps=3).start()
    tb = BackgroundTrainer(step_b, steps=3).start()
    assert ta.running and tb.running and ta.replaced_by is None
    gate.set()
    assert ta.wait(timeout_s=30).steps_done == 3 and tb.wait(timeout_s=30).steps_done == 3


def test_a_run_that_does_not_stop_in_time_is_not_taken_over(monkeypatch) -> None:
    monkeypatch.setattr("superoffload.widgets.shared.trainer.TAKE_OVER_S", 0.2)
    gate = threading.Event()
    engine = FakeEngine()
    step = _stepper(engine.telemetry, gate)
    step.engine = engine
    first = BackgroundTrainer(step, name="first").start()
    with pytest.raises(RuntimeError, match="did not stop within .* still trains"):
        BackgroundTrainer(step, name="second").start()
    assert BackgroundTrainer.training(engine) is first and first.replaced_by is None
    gate.set()
    first.stop(timeout_s=30)


def test_a_dashboard_started_again_on_the_same_recorder_freezes_the_old_one() -> None:
    rec = Recorder()
    old, new = LiveDashboard(rec, live=False), LiveDashboard(rec, live=False)
    old.start(hz=50)
    assert owners.owner_of("refresh", rec) is old
    new.start(hz=50)
    try:
        assert not old.running and owners.owner_of("refresh", rec) is new
    finally:
        new.stop()


def test_the_fallback_draws_only_when_the_live_figure_said_nothing_in_time() -> None:
    due = box_mod.fallback_due
    after = box_mod.FALLBACK_AFTER_S
    assert not due(now_s=after - 0.1, shown_s=0.0, initialized=False, has_data=True,
                   last_s=-1e9), "before the time limit"
    assert due(now_s=after, shown_s=0.0, initialized=False, has_data=True, last_s=-1e9)
    assert not due(now_s=after, shown_s=0.0, initialized=True, has_data=True, last_s=-1e9)
    assert not due(now_s=after, shown_s=0.0, initialized=False, has_data=False, last_s=-1e9)
    assert not due(now_s=after, shown_s=None, initialized=False, has_data=True, last_s=-1e9)
    every = box_mod.FALLBACK_EVERY_S
    assert not due(now_s=after + 1, shown_s=0.0, initialized=False, has_data=True,
                   last_s=after + 1 - every / 2), "redrawn every FALLBACK_EVERY_S, not more"


def test_a_live_figure_that_never_starts_gets_a_copy_redrawn_in_place(monkeypatch) -> None:
    pytest.importorskip("anywidget")
    rec = Recorder()
    dash = LiveDashboard(rec, live=True)
    assert dash.box is not None and dash.box.fallback in dash.widget.children
    t = 0.0
    for it in range(6):
        t = record_iteration(rec, it, t, loss=3.0) + 0.001
    dash.box.shown_s = -1e9  # shown long ago, and the browser never said "initialized"
    monkeypatch.setattr("superoffload.widgets.shared.env.kernel_can_hear", lambda: True)
    dash.refresh()
    (out,) = dash.box.fallback.outputs
    fig = out["data"]["application/vnd.plotly.v1+json"]
    assert "did not start" in fig["layout"]["title"]["text"] and fig["data"]
    lines = dash.status_lines()
    assert any(line.startswith("note: the live figure did not start") for line in lines)
    # the browser speaks at last (a cell held the kernel): the copy goes
    dash.plot._on_msg(dash.plot, {"event": "initialized"}, [])
    dash.refresh()
    assert dash.box.fallback.outputs == () and not dash.box.fallback_on


def test_a_snapshot_sent_while_no_page_was_open_is_sent_again_at_shutdown(monkeypatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(snap._env, "in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.update_display",
                        lambda bundle, raw, display_id: sent.append(display_id))
    slot = snap.OutputSlot("dashboard")
    slot.shown = True
    slot.update({"text/plain": "the run's static figure"})  # went to nobody
    sent.clear()
    snap.freeze_all()
    assert slot.display_id in sent, "the page that is open now gets the snapshot"
    live = snap.OutputSlot("trainer")
    live.shown = True
    live.update({snap.WIDGET_MIME: {"model_id": "x"}})
    sent.clear()
    snap.freeze_all()
    assert live.display_id not in sent, "a live widget is not a snapshot: not re-sent"


def test_the_refresher_gives_way_to_busy_lanes_then_refreshes_anyway() -> None:
    from superoffload.widgets.shared.refresher import GIVE_WAY_TRIES, Refresher

    calls = threading.Event()
    busy_checks: list[bool] = []

    def busy() -> bool:
        busy_checks.append(True)
        return True  # the engine's lanes never idle

    r = Refresher(calls.set, hz=50, name="t-refresher", busy=busy)
    r.start()
    try:
        assert calls.wait(10), "a refresh comes anyway, after its waits for a gap"
    finally:
        r.stop()
    assert r.gave_way >= GIVE_WAY_TRIES and len(busy_checks) >= GIVE_WAY_TRIES
    quiet = threading.Event()
    r = Refresher(quiet.set, hz=50, name="t-quiet", busy=lambda: False)
    r.start()
    try:
        assert quiet.wait(10)
    finally:
        r.stop()
    assert r.gave_way == 0, "idle lanes: no wait"
