"""Rollback of a skipped step restores the low-precision weights too.

A bf16 model with host casting keeps a bf16 copy of each offloaded parameter on the host
(``lp_host``: the kernel writes it in the step's pass and the H2D moves it). When a step is
skipped, every speculative step is undone and the restored weights are published; if the
bf16 copy were not restored with the fp32 master, the next forward would run with the
weights of a step that never happened. Checked right after the skipped step, by value:

* device weights == bf16(master), exactly (round to nearest even, as the kernel's copy);
* snapshot rollback: the masters equal the run without speculation, bit for bit (it
  restores pre-step copies), after the skipped step and at the end of the run;
* inverse and "auto" rollback: the kernel's inverse rewrites the bf16 copy in its pass, so
  device == bf16(master) holds there too. (This run keeps no element aside under "auto";
  tests/test_auto_rollback.py covers the kept elements.)
"""

from __future__ import annotations

import pytest
import torch
from _engine_ref import HYPER, cpu_config
from _tiny_models import batches, make_model

import superoffload as so

STEPS, BAD = 6, 3

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def run(config: so.OffloadConfig) -> tuple[dict, dict, dict, int]:
    """(masters after the skipped step, device weights then, masters at the end, rollbacks)."""
    model = make_model(dtype=torch.bfloat16)
    step = {"now": -1}

    def poison(grad: torch.Tensor) -> torch.Tensor:  # one non-finite bucket in step BAD
        return grad * float("nan") if step["now"] == BAD else grad

    model.blocks[-1].fc2.weight.register_hook(poison)
    with so.initialize(model, dict(HYPER), config) as engine:
        for k, (x, y) in enumerate(batches(STEPS)):
            step["now"] = k
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            if k == BAD:
                after_skip = engine.master_weights()  # synchronizes: the H2D copies landed
                device = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert engine.stats.skipped_steps == 1
        return after_skip, device, engine.master_weights(), engine.stats.rollbacks


@pytest.mark.parametrize("rollback", ["snapshot", "inverse", "auto"])
def test_skipped_step_restores_the_bf16_copy(rollback: str) -> None:
    config = cpu_config(ratio=1.0, grad_cast="host", param_cast="host", rollback=rollback)
    after_skip, device, final, rollbacks = run(config)
    assert rollbacks > 0  # buckets other than the poisoned one were speculated and undone
    for name, master in after_skip.items():
        assert torch.equal(device[name], master.to(torch.bfloat16)), name
    if rollback == "snapshot":
        off_skip, _, off_final, off_rollbacks = run(config.replace(speculation="off"))
        assert off_rollbacks == 0
        for name in off_skip:
            assert torch.equal(after_skip[name], off_skip[name]), name
            assert torch.equal(final[name], off_final[name]), name
