"""Failures reach the training thread; nothing hangs; close() releases the threads."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from _engine_ref import cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime import lifetime, steps
from superoffload.runtime.devices import CpuDeviceOps
from superoffload.runtime.errors import EngineClosed, EngineError, WatchdogTimeout

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


cfg = functools.partial(cpu_config, ratio=0.5)


def train(model, engine, n):
    for x, y in batches(n):
        engine.backward(model(x, y))
        engine.step()
        engine.zero_grad()
    engine.synchronize()


def test_worker_exception_reaches_caller(monkeypatch):
    def boom(self):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(steps.StepTask, "run", boom)
    model = make_model()
    engine = so.initialize(model, {}, cfg())
    with pytest.raises(EngineError, match="cpu_worker.*kernel exploded") as info:
        train(model, engine, 3)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineError):  # and it stays raised: no silent loss
        engine.step()
    engine.close()
    engine.close()  # idempotent
    assert all(not lane.alive for lane in engine.lanes)


def test_transfer_exception_reaches_caller(monkeypatch):
    def broken(self, grads, dst, ready):
        raise OSError("link down")

    monkeypatch.setattr(CpuDeviceOps, "d2h", broken)
    model = make_model()
    with so.initialize(model, {}, cfg()) as engine, pytest.raises(
        EngineError, match="d2h.*link down"
    ):
        train(model, engine, 3)
    assert all(not lane.alive for lane in engine.lanes)


def test_watchdog_names_stuck_bucket(monkeypatch):
    release = threading.Event()
    real = steps.StepTask.run

    def stuck(self):
        release.wait(30)  # the CPU worker hangs until the test has seen the watchdog fire
        return real(self)

    monkeypatch.setattr(steps.StepTask, "run", stuck)
    model = make_model()
    engine = so.initialize(model, {}, cfg(watchdog_s=0.3, speculation="off"))
    try:
        with pytest.raises((WatchdogTimeout, EngineError), match=r"bucket \d+"):
            train(model, engine, 2)
    finally:
        release.set()
        engine.close()


def _hang_first_cpu_step(monkeypatch) -> tuple[threading.Event, list[int]]:
    """The first CPU step hangs (until the event is set); the others queue behind it.
    Returns (the event, [the hung bucket's id] once it hangs)."""
    release, hung = threading.Event(), []
    real = steps.StepTask.run

    def stuck(self):
        if not hung:  # runs on the one CPU worker thread: no race on `hung`
            hung.append(self.bucket)
            release.wait(60)
        return real(self)

    monkeypatch.setattr(steps.StepTask, "run", stuck)
    return release, hung


def test_watchdog_names_the_late_cpu_step_not_the_device(monkeypatch):
    """A hung CPU step used to be reported as "transfer lanes: lane d2h, lane h2d; a
    copy that never ends means a hung device". The message names the lane and the bucket
    that is late, and blames no device while no copy is running."""
    release, hung = _hang_first_cpu_step(monkeypatch)
    model = make_model()
    engine = so.initialize(model, {}, cfg(watchdog_s=0.5, speculation="off"))
    try:
        with pytest.raises(WatchdogTimeout) as info:
            train(model, engine, 2)
        msg = str(info.value)
        assert f"StepTask of bucket {hung[0]}" in msg and "lane cpu_worker" in msg, msg
        assert "hung device" not in msg and "no copy is running" in msg, msg
    finally:
        release.set()
        engine.close()


def test_close_with_a_hung_cpu_step_waits_close_timeout_not_the_watchdog(monkeypatch):
    """close() waited watchdog_s + 5 s (305 s by default) for a hung CPU step where
    the docs promise at most CLOSE_TIMEOUT_S without progress. Here watchdog_s = 20 s and
    CLOSE_TIMEOUT_S = 1 s: close() returns within a few seconds (it took 21 s before) and
    raises WatchdogTimeout naming the abandoned lane and bucket."""
    monkeypatch.setattr(lifetime, "CLOSE_TIMEOUT_S", 1.0)
    release, hung = _hang_first_cpu_step(monkeypatch)
    model = make_model()
    engine = so.initialize(model, {}, cfg(watchdog_s=20.0))
    try:
        x, y = batches(1)[0]
        engine.backward(model(x, y))  # speculation: the CPU steps start during backward
        t0 = time.monotonic()
        with pytest.raises(WatchdogTimeout, match=r"close\(\): lane cpu_worker") as info:
            engine.close()
        took = time.monotonic() - t0
        assert took < 8.0, f"close() took {took:.1f} s"  # ~1 s; 21 s before the fix
        assert f"StepTask of bucket {hung[0]}" in str(info.value)
        assert engine.closed and engine.hooks == []  # cleanup completed all the same
        with pytest.raises(EngineClosed):
            engine.step()
    finally:
        release.set()


def test_close_waits_for_work_that_progresses(monkeypatch):
    """The bound of close() is on progress, not on the total: CPU steps that each take
    0.3 s, queued ~1 s worth at close(), with CLOSE_TIMEOUT_S = 0.5 s, all run and publish;
    the model ends with the same weights as when synchronize() drains them first."""
    monkeypatch.setattr(lifetime, "CLOSE_TIMEOUT_S", 0.5)
    real = steps.StepTask.run

    def slow(self):
        time.sleep(0.3)
        return real(self)

    monkeypatch.setattr(steps.StepTask, "run", slow)
    results = []
    for drain_first in (True, False):
        model = make_model()
        engine = so.initialize(model, {}, cfg(speculation="off"))
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        engine.step()  # the CPU steps are queued now, not run
        host = [b for b in engine.state.buffers if not b.on_device]
        assert len(host) * 0.3 > 0.5  # more work queued than one quiet bound
        if drain_first:
            engine.synchronize()
        engine.close()  # raises WatchdogTimeout if it gave up
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_closed_engine_refuses_work():
    model = make_model()
    engine = so.initialize(model, {}, cfg())
    engine.close()
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="closed"):
        engine.backward(model(x, y))


def test_bad_inputs_raise_naming_the_field():
    model = make_model()
    with pytest.raises(ValueError, match="lr"):
        so.initialize(model, {"lr": -1.0}, cfg())
    with pytest.raises(ValueError, match="unknown key"):
        so.initialize(model, {"learning_rate": 1.0}, cfg())
    with pytest.raises(so.ConfigError, match="ratio"):
        so.initialize(model, {}, cfg(ratio=2.0))
    with pytest.raises(TypeError, match="not a torch optimizer"):
        so.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg())
