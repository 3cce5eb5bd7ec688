"""Failures reach the training thread; nothing hangs; close() releases the threads."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from _engine_ref import cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime import steps
from superoffload.runtime.backend import CPUBackend
from superoffload.runtime.engine import EngineError
from superoffload.runtime.transfers import WatchdogTimeout

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

    monkeypatch.setattr(CPUBackend, "d2h", broken)
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
