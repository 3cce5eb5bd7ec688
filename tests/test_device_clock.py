"""Device-side spans on the device's clock: forward, backward, transfers and the
device optimizer step are timed by the recorder's clock (CUDA events on a GPU, host time on
the CPU), resolved when the device reaches them; the CPU optimizer stays on the host clock.
And a D2H lane that returns before the copy landed (CUDA's PendingStats) is waited for by the
steps and the validation that read the data."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _engine_ref import HYPER
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import OffloadConfig
from superoffload.runtime.devices import CpuDeviceOps, GradStats
from superoffload.telemetry.recorder import Recorder

OFFSET = 1000.0  # the fake device clock runs 1000 s ahead of the host clock


class FakeDeviceClock:
    """Marks that resolve only once the test says the device got there."""

    def __init__(self, rec: Recorder) -> None:
        self.rec, self.reached = rec, False

    def mark(self, stream: Any = None) -> float:
        return self.rec.now() + OFFSET

    def seconds(self, mark: Any) -> float | None:
        return float(mark) if self.reached else None


def test_device_spans_wait_until_the_device_reaches_them() -> None:
    rec = Recorder()
    rec.clock = clock = FakeDeviceClock(rec)
    with rec.device_span("d2h", "d2h", iteration=0, bucket=3, nbytes=8):
        pass
    rec.add("cpu_optimizer", "cpu_step", 1.0, 2.0, iteration=0, bucket=3)
    assert [s.kind for s in rec.spans()] == ["cpu_step"]  # the copy has not landed yet
    clock.reached = True
    spans = {s.kind: s for s in rec.spans()}  # readers flush first
    assert spans["d2h"].start_s >= OFFSET and spans["d2h"].bucket == 3
    assert spans["d2h"].nbytes == 8 and spans["cpu_step"].start_s == 1.0


def test_the_engine_times_device_work_on_the_device_clock() -> None:
    model = make_model(0)
    config = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.5, cpu_threads=1)
    with so.initialize(model, HYPER, config) as engine:
        clock = FakeDeviceClock(engine.telemetry)
        clock.reached = True
        engine.telemetry.clock = clock
        x, y = batches(1, seed=1, batch=4, seq=12)[0]
        engine.backward(model(x, y))
        engine.step()
        engine.synchronize()
        spans = engine.telemetry.spans()
    device = {"forward", "backward", "d2h", "h2d", "device_step"}
    kinds = {s.kind for s in spans}
    assert device | {"cpu_step"} <= kinds
    for s in spans:
        if s.kind in device:
            assert s.start_s >= OFFSET, s  # from the device clock
        elif s.kind == "cpu_step":
            assert s.start_s < OFFSET, s   # host work: the host clock


@dataclass(frozen=True)
class LateStats:
    """Statistics whose copy lands later (as CUDA's PendingStats after an async D2H)."""

    stats: GradStats
    landed: threading.Event

    def resolve(self) -> GradStats:
        assert self.landed.wait(30)
        return self.stats


def test_consumers_wait_for_gradients_that_land_after_the_d2h_task(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=1.0, cpu_threads=1,
                           max_grad_norm=0.05, rollback="snapshot")
    data = batches(3, seed=1, batch=4, seq=12)

    def train() -> dict[str, torch.Tensor]:
        model = make_model(0)
        with so.initialize(model, HYPER, config) as engine:
            for x, y in data:
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            return engine.master_weights()

    want = train()
    real = CpuDeviceOps.d2h
    timers: list[threading.Timer] = []

    def late(self: CpuDeviceOps, grads: Any, dst: Any, ready: Any) -> LateStats:
        landed = threading.Event()
        t = threading.Timer(0.02, landed.set)  # the "copy" lands 20 ms after the task returned
        timers.append(t)
        t.start()
        return LateStats(real(self, grads, dst, ready), landed)

    monkeypatch.setattr(CpuDeviceOps, "d2h", late)
    got = train()
    assert timers
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.cuda
def test_cuda_clock_marks_follow_the_host_clock() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from superoffload.runtime.device_clock import CudaClock

    rec = Recorder()
    clock = CudaClock(torch.device("cuda"), rec.now)
    a = clock.mark()
    torch.cuda._sleep(10_000_000)  # ~several ms of GPU time
    b = clock.mark()
    torch.cuda.synchronize()
    ta, tb = clock.seconds(a), clock.seconds(b)
    assert ta is not None and tb is not None and tb > ta
    assert abs(tb - rec.now()) < 1.0  # aligned to the host clock
