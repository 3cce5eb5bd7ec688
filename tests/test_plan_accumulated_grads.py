"""The planner charges gradient accumulation's device gradients from the start of a later
micro-step (plan/memory.py, plan/device_grads.py ``carried_numel``).

Over ``grad_accum_steps`` > 1 the GPU tail's gradients (and, accumulating on the device, the
offloaded ones) sum in ``.grad``: during a later micro-step's backward they are all resident
from its first layer on, while the activations are at their largest, not only once the tail's
layers produce them again. Measured with the engine's ``DeviceMeter`` on the tiny GPT
(tests/test_plan_device_memory.py's model and batch), two optimizer steps of two micro-steps:
the planner's kept peak and its gradient part at that peak are within 1% of what the engine
holds (measured 0.2%); charging the tail's gradients only as they arrive misses up to the
whole tail's bytes (about 6% of the peak here, 60% of the gradient part).
"""

from __future__ import annotations

import pytest
from test_plan_device_memory import LAPTOP, MB, SEQ, _batch, _gpt

import superoffload as so
from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.runtime.device_meter import DeviceMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("place", ["host", "device"])
@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_accumulated_tail_gradients_are_charged_from_the_first_layer(ratio: float,
                                                                     place: str) -> None:
    model = _gpt()
    cfg = OffloadConfig(device="cpu", bucket_bytes=16384, cpu_threads=1, ratio=ratio,
                        grad_accum_steps=2, grad_accum_on=place)
    x, y = _batch()
    with so.initialize(model, {}, cfg, inline=True) as engine:
        assert any(b.on_device for b in engine.bucket_plan.buckets)  # a GPU tail
        meter = DeviceMeter(model, engine=engine)
        for _ in range(2):
            for _ in range(cfg.grad_accum_steps):
                with meter.track():
                    engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
    shape = plan.ModelShape.from_module(model, seq=SEQ, micro_batch=MB,
                                        activation_checkpointing=False)
    mem = plan.simulate(shape, LAPTOP, "superoffload", cfg).memory_detail
    assert mem.device_kept == pytest.approx(meter.peak_bytes, rel=0.01), (
        meter.peak_parts, mem.device_parts)
    assert mem.device_parts["grads"] == pytest.approx(meter.peak_parts["grads"], rel=0.01)
    assert mem.device_parts["activations"] == pytest.approx(meter.peak_parts["activations"],
                                                            rel=0.01)

