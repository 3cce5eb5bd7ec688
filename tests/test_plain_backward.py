"""Plain ``loss.backward()`` loops with gradient accumulation (runtime/launch.py, "micro-steps").

``OffloadConfig(grad_accum_steps=K)`` with the user's own ``loss.backward()``: the engine
steps once per K backward passes whether ``step()`` is called on every micro-batch
(DeepSpeed's and Accelerate's habit) or once per K (torch's), and matches AdamW on the
accumulated gradients; more passes than K, or mixing with ``engine.backward``, is refused
with nothing changed.
"""

from __future__ import annotations

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime.contract import ContractError

pytestmark = pytest.mark.usefixtures("one_thread")
GAS, STEPS = 2, 3
DATA = batches(GAS * STEPS)


def config(**kw):
    return cpu_config(**{"ratio": 0.5, "grad_accum_steps": GAS, "max_grad_norm": 0.5, **kw})


@pytest.mark.parametrize("step_every_micro_batch", [True, False])
def test_plain_backward_accumulates_and_matches_adamw(step_every_micro_batch):
    want = train_reference(make_model(), DATA, steps=STEPS, gas=GAS, max_norm=0.5)
    model = make_model()
    with so.initialize(model, dict(HYPER), config()) as engine:
        for k, (x, y) in enumerate(DATA):
            (model(x, y) / GAS).backward()
            if step_every_micro_batch or (k + 1) % GAS == 0:
                engine.step()
                engine.zero_grad()  # mid-accumulation: keeps the partial sums
        got = engine.master_weights()
        assert engine.stats.iterations == STEPS  # not one per micro-batch
    assert max_diff(want, got) < 1e-6


def test_more_passes_than_grad_accum_steps_are_refused_and_change_nothing():
    model = make_model()
    with so.initialize(model, dict(HYPER), config()) as engine:
        before = engine.master_weights()
        for x, y in DATA[:GAS + 1]:
            model(x, y).backward()
        with pytest.raises(ContractError, match=f"{GAS + 1} loss.backward"):
            engine.step()
        assert max_diff(before, engine.master_weights()) == 0.0
        assert engine.stats.iterations == 0
        engine.zero_grad()  # discards them; the loop goes on
        for x, y in DATA[:GAS]:
            model(x, y).backward()
        engine.step()
        assert engine.stats.iterations == 1


def test_mixing_plain_and_engine_backward_is_refused():
    model = make_model()
    with so.initialize(model, dict(HYPER), config()) as engine:
        before = engine.master_weights()
        (model(*DATA[0]) / GAS).backward()
        with pytest.raises(ContractError, match="one kind of backward"):
            engine.backward(model(*DATA[1]))
        assert max_diff(before, engine.master_weights()) == 0.0
        (model(*DATA[1]) / GAS).backward()  # the window finishes as it began
        engine.step()
        engine.zero_grad()
        got = engine.master_weights()
    assert max_diff(train_reference(make_model(), DATA, steps=1, gas=GAS, max_norm=0.5), got) < 1e-6


def test_clip_grad_norm_in_a_plain_loop_waits_for_the_last_pass():
    model = make_model()
    with so.initialize(model, dict(HYPER), config()) as engine:
        x, y = DATA[0]
        (model(x, y) / GAS).backward()
        with pytest.raises(ContractError, match="still accumulating"):
            engine.clip_grad_norm_(1.0)
        (model(*DATA[1]) / GAS).backward()
        norm = float(engine.clip_grad_norm_(1.0))
        engine.step()
    ref = make_model()
    for x, y in DATA[:GAS]:
        (ref(x, y) / GAS).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    assert norm == pytest.approx(want, rel=1e-6)
