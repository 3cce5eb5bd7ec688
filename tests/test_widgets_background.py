"""BackgroundTrainer: runs off the calling thread, stops on request, surfaces errors, routes
its output to the starting cell, and drives the dashboard's refresher."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared import trainer as trainer_module
from superoffload.widgets.shared.runstate import RunState
from superoffload.widgets.shared.trainer import BackgroundTrainer
from tests.widgets_support import FakeShell, record_iteration


def test_runs_every_step_on_another_thread_and_returns_the_losses() -> None:
    threads: set[str] = set()

    def step(i: int) -> float:
        threads.add(threading.current_thread().name)
        return 10.0 - i

    trainer = BackgroundTrainer(step, steps=5, name="t-run").start()
    result = trainer.wait(timeout_s=30)
    assert threads == {"t-run"}
    assert result.steps_done == 5 and not result.stopped_early
    assert result.losses == [10.0, 9.0, 8.0, 7.0, 6.0]
    assert (result.first_loss, result.final_loss) == (10.0, 6.0)
    assert not trainer.running and "finished, step 5 of 5" in trainer.status()
    assert result.state is RunState.FINISHED
    bar, label, button = trainer.progress.children
    assert bar.value == 1.0 and bar.bar_style == "success" and button.disabled


def test_stop_ends_the_loop_between_steps() -> None:
    release = threading.Event()
    started = threading.Event()

    def step(i: int) -> None:
        started.set()
        release.wait(30)

    trainer = BackgroundTrainer(step, steps=1000).start()
    assert started.wait(30)
    trainer.progress.children[2].click()  # the Stop button
    release.set()
    result = trainer.wait(timeout_s=30)
    assert result.stopped_early and result.steps_done == 1 and result.state is RunState.STOPPED
    assert result.losses == [] and "stopped" in trainer.status()


def test_without_steps_it_runs_until_stopped_or_its_time_limit(monkeypatch) -> None:
    # the trainer's clock is a fake that each step moves on by 1/16 s: the 0.25 s limit comes
    # after exactly four steps however loaded the machine is (on the wall clock a loaded
    # machine ran one 5 ms step in 0.2 s)
    clock = [0.0]
    status_read = threading.Event()

    def step(i: int) -> None:
        status_read.wait(30)  # the status below is read while the run goes
        clock[0] += 0.0625

    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer = BackgroundTrainer(step, max_s=0.25).start()
    assert "stops after" in trainer.status()
    status_read.set()
    result = trainer.wait(timeout_s=30)
    assert result.state is RunState.FINISHED and not result.stopped_early
    assert result.steps_done == 4
    monkeypatch.undo()
    endless = BackgroundTrainer(lambda i: time.sleep(0.002)).start()
    assert endless.wait_for_steps(5, timeout_s=30) >= 5 and "until stopped" in endless.status()
    endless.stop()
    assert endless.wait(timeout_s=30).state is RunState.STOPPED


def test_an_exception_in_the_thread_is_re_raised_by_wait(capsys) -> None:
    def step(i: int) -> float:
        if i == 2:
            raise ArithmeticError("boom at 2")
        return 1.0

    trainer = BackgroundTrainer(step, steps=5).start()
    with pytest.raises(RuntimeError, match="failed at step 2") as info:
        trainer.wait(timeout_s=30)
    assert isinstance(info.value.__cause__, ArithmeticError)
    assert "boom at 2" in capsys.readouterr().out
    assert trainer.progress.children[0].bar_style == "danger" and trainer.state is RunState.FAILED


def test_thread_output_goes_to_the_cell_that_started_it(monkeypatch) -> None:
    shell = FakeShell()
    monkeypatch.setattr(_env, "_get_ipython", lambda: shell)
    trainer = BackgroundTrainer(lambda i: 0.0, steps=2, name="t-out").start()
    shell.parent = {"header": {"msg_id": "a-later-cell"}}  # the user runs another cell
    trainer.wait(timeout_s=30)
    assert shell.thread_parents == [("t-out", {"header": {"msg_id": "cell-1"}})]


def test_the_dashboard_and_the_tuner_follow_the_run_and_get_a_final_refresh() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec, refresh_hz=20)
    seen: list[RunState] = []
    tuner = SimpleNamespace(set_run_state=seen.append)
    t = [0.0]

    def step(i: int) -> float:
        t[0] = record_iteration(rec, i, t[0], loss=3.0 - 0.1 * i) + 0.001
        return 3.0 - 0.1 * i

    trainer = BackgroundTrainer(step, steps=6, dashboard=dash, tuner=tuner).start()
    trainer.wait(timeout_s=30)
    assert not dash.running, "the refresher stops with the run"
    assert len(dash.state.series()["iteration"]) == 6
    assert len(dash.state.loss) == 6
    assert seen == [RunState.RUNNING, RunState.FINISHED]
    assert dash.run_state is RunState.FINISHED and "finished" in dash.summary()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"steps": 0}, "steps"), ({"steps": 2.5}, "steps"),
     ({"steps": 3, "print_every": -1}, "print_every"), ({"max_s": 0}, "max_s")],
)
def test_bad_arguments_name_the_field(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        BackgroundTrainer(lambda i: None, **kwargs)


def test_not_callable_and_wait_before_start_and_double_start() -> None:
    with pytest.raises(TypeError, match="step_fn"):
        BackgroundTrainer(42, steps=1)  # type: ignore[arg-type]
    trainer = BackgroundTrainer(lambda i: None, steps=1)
    with pytest.raises(RuntimeError, match="never started"):
        trainer.wait()
    trainer.start().wait(timeout_s=30)
    with pytest.raises(RuntimeError, match="already started"):
        trainer.start()


def test_wait_for_steps_blocks_until_that_many_steps_are_done() -> None:
    gate = threading.Semaphore(0)

    def step(i: int) -> float:
        gate.acquire()  # each step waits for the test's permission
        return float(i)

    trainer = BackgroundTrainer(step, steps=10, name="t-wait").start()
    with pytest.raises(TimeoutError, match="did only 0 of 3 steps"):
        trainer.wait_for_steps(3, timeout_s=0.2)
    for _ in range(3):
        gate.release()
    assert trainer.wait_for_steps(3, timeout_s=30) >= 3
    for _ in range(7):
        gate.release()
    assert trainer.wait_for_steps(50, timeout_s=30) == 10  # the run ended first
    assert trainer.wait(timeout_s=30).steps_done == 10
