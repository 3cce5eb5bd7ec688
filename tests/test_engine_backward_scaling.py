"""``engine.backward(loss, scale_wrt_gas=False)`` does not divide by ``grad_accum_steps``
(DeepSpeed's meaning: the caller divided already), checked by value: the gradient norm the
engine validates and returns equals torch's norm of the accumulated ``.grad``, and the run
matches AdamW, against the default (which divides) on the same undivided losses."""

from __future__ import annotations

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")
GAS, STEPS = 2, 3
DATA = batches(GAS * STEPS)


def torch_run(divide: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """AdamW on sum over micro-batches of loss (/ GAS when ``divide``); eps 1e-3 makes the
    update depend on the gradient's scale (Adam is otherwise scale-invariant)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **{**HYPER, "eps": 1e-3})
    norms = []
    for k in range(STEPS):
        for j in range(GAS):
            loss = model(*DATA[k * GAS + j])
            (loss / GAS if divide else loss).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("scale_wrt_gas", [True, False])
def test_scale_wrt_gas_divides_only_when_asked(scale_wrt_gas):
    model = make_model()
    config = cpu_config(ratio=0.5, grad_accum_steps=GAS)
    norms = []
    with so.initialize(model, {**HYPER, "eps": 1e-3}, config) as engine:
        for k in range(STEPS):
            for j in range(GAS):
                engine.backward(model(*DATA[k * GAS + j]), scale_wrt_gas=scale_wrt_gas)
            norms.append(float(engine.clip_grad_norm_(1e9)))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    want, want_norms = torch_run(divide=scale_wrt_gas)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert max_diff(got, want) < 1e-5
    other, other_norms = torch_run(divide=not scale_wrt_gas)  # the test tells them apart
    assert other_norms[0] == pytest.approx(want_norms[0] * (GAS if scale_wrt_gas else 1 / GAS),
                                           rel=1e-5)
    assert max_diff(got, other) > 1e-4
