"""reconfigure() from another thread while training runs in a background thread."""

from __future__ import annotations

import threading

import pytest
import torch
from _engine_ref import HYPER, max_diff, train_reference
from _tiny_models import batches, make_model

import superoffload as so

STEPS, SWITCH = 12, 5


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reconfigure_from_another_thread_matches_reference(dtype):
    data = batches(STEPS)
    ref = train_reference(make_model(dtype=dtype), data, steps=STEPS, max_norm=0.5)
    model = make_model(dtype=dtype)
    config = so.OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.5, cpu_threads=1,
                              max_grad_norm=0.5, grad_cast="host", param_cast="host")
    engine = so.initialize(model, dict(HYPER), config)
    reached, changed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def loop():  # the training thread (as in a notebook with a background trainer)
        try:
            for step, (x, y) in enumerate(data):
                if step == SWITCH:
                    reached.set()
                    changed.wait(30)
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=loop)
    worker.start()
    assert reached.wait(30)
    n_host_before = len(engine.bucket_plan.host_buckets)
    engine.reconfigure(ratio=1.0, bucket_bytes=8192, grad_cast="device", param_cast="device",
                       speculation="off")
    changed.set()
    worker.join(60)
    assert not worker.is_alive() and not errors, errors
    ratios = [s.value for s in engine.telemetry.scalars("ratio")]
    assert ratios[:SWITCH] == [0.5] * SWITCH and ratios[SWITCH:] == [1.0] * (STEPS - SWITCH)
    spec = [s.value for s in engine.telemetry.scalars("speculating")]
    assert spec[SWITCH - 1] == 1.0 and spec[SWITCH:] == [0.0] * (STEPS - SWITCH)
    assert engine.bucket_plan.offloaded_fraction == 1.0 and n_host_before > 0
    assert engine.bucket_plan.bucket_bytes == 8192
    assert all(not b.on_device for b in engine.bucket_plan.buckets)
    assert any("reconfigure applied" in n.text and "ratio 0.5 -> 1.0" in n.text
               for n in engine.telemetry.notes())
    got = engine.master_weights()
    engine.close()
    assert max_diff(ref, got) < (1e-5 if dtype == torch.float32 else 1e-3)


def test_reconfigure_rejects_bad_values_at_once():
    engine = so.initialize(make_model(), {}, so.OffloadConfig(device="cpu"), inline=True)
    with pytest.raises(so.ConfigError, match="ratio"):
        engine.reconfigure(ratio=3.0)
    with pytest.raises(so.ConfigError, match="device"):
        engine.reconfigure(device="cuda")
    engine.close()
