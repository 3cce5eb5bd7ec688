"""Overlap is structural: buckets leave during backward, and the next forward waits only
for the bucket of the module about to run (paper §4.2). Checked by ordering, not timing."""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
from _engine_ref import cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime import steps
from superoffload.runtime.lanes import Barrier

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


cfg = functools.partial(cpu_config, ratio=0.5)


def test_buckets_offloaded_and_stepped_during_backward():
    model = make_model()
    with so.initialize(model, {}, cfg(), inline=True) as engine:
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        spans = engine.telemetry.spans()
        backward = next(s for s in spans if s.kind == "backward")
        d2h = [s for s in spans if s.kind == "d2h"]
        cpu = [s for s in spans if s.kind == "cpu_step"]
        n_host = len(engine.bucket_plan.host_buckets)
        assert len(d2h) == len(cpu) == n_host
        # every offloaded bucket was copied AND speculatively stepped before backward ended
        assert all(s.end_s <= backward.end_s for s in d2h + cpu)
        engine.step()


def test_next_forward_waits_only_for_its_own_bucket(monkeypatch):
    model = make_model()
    release = threading.Event()
    real = steps.StepTask.run
    engine = so.initialize(model, {}, cfg())
    last_layers = engine.bucket_plan.buckets[0].id  # first bucket of backward: the head's side

    def held(task):
        if task.bucket == last_layers:
            release.wait(30)  # the CPU is still busy with the last layers' bucket
        return real(task)

    monkeypatch.setattr(steps.StepTask, "run", held)
    first_layer_ran = threading.Event()
    model.blocks[0].register_forward_pre_hook(lambda m, a: first_layer_ran.set())
    try:
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        engine.step()
        engine.zero_grad()
        first_layer_ran.clear()
        done = threading.Event()
        forward = threading.Thread(target=lambda: (model(x, y), done.set()))
        forward.start()
        # the first layers (GPU tail + early offloaded buckets) run although the CPU has
        # not finished the last layers' bucket; the forward then waits for that bucket
        assert first_layer_ran.wait(30)
        assert not done.is_set()
        release.set()
        forward.join(30)
        assert done.is_set()
        waits = [s for s in engine.telemetry.spans() if s.kind == "wait"]
        assert any(s.bucket == last_layers for s in waits)
    finally:
        release.set()
        engine.close()


@dataclasses.dataclass(frozen=True)
class _Hold:
    """A worker task that holds the CPU lane until released (the CPU "is busy")."""

    release: threading.Event

    def run(self) -> None:
        self.release.wait(30)


@pytest.mark.parametrize("order", ["deadline", "fifo"])
def test_ready_buckets_are_stepped_and_sent_earliest_deadline_first(order: str) -> None:
    """When several offloaded buckets are ready at once, the one the next forward needs first
    (the highest bucket id: the first layers, produced last by backward) is stepped and its
    weights sent first; "fifo" keeps gradient-ready order (DESIGN.md §6)."""
    model = make_model()
    with so.initialize(model, {}, cfg(ratio=1.0, step_order=order)) as engine:
        release = threading.Event()
        engine.cpu_worker.submit(_Hold(release))  # every spec step queues behind this
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        for lane in engine.transport.lanes[:1]:  # every gradient landed: all steps are ready
            lane.submit(Barrier()).result(timeout=30)
        release.set()
        engine.step()
        engine.synchronize()
        spans = engine.telemetry.spans()
    n_host = len([b for b in engine.bucket_plan.buckets if not b.on_device])
    assert n_host >= 4
    cpu = [s.bucket for s in sorted(spans, key=lambda s: s.start_s) if s.kind == "cpu_step"]
    h2d = [s.bucket for s in sorted(spans, key=lambda s: s.start_s) if s.kind == "h2d"]
    want = sorted(range(n_host), reverse=order == "deadline")
    assert cpu == want
    assert h2d == want  # each H2D issued as soon as its step ended, in the same order
