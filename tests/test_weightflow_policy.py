"""The automatic weight policy (paper §4.5), switching between iterations, and capacity.

* pure: ``choose_weights`` picks weight-flow for long sequences (activations dominate, the
  fetch hides behind compute) and weight-stationary otherwise, on the planner alone;
* engine: weights="auto" reads (micro-batch, seq) from the first batch and decides the same
  way; the choice and its reason land in telemetry notes;
* switching stationary -> flow -> stationary between iterations keeps training exact;
* capacity: the largest GPT each policy trains under a simulated device-memory cap on the
  CPU backend (``DeviceMeter`` as the out-of-memory), next to the planner's prediction.
"""

from __future__ import annotations

import pytest
import torch
from _engine_ref import HYPER, max_diff, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload import plan
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.plan import choose_weights
from superoffload.plan.memory import check_fits, memory
from superoffload.plan.techniques import resolve
from superoffload.runtime.device_meter import DeviceBudgetExceeded, DeviceMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ----------------------------------------------------------------------------- pure planner side
def gpt_1b3(seq: int) -> plan.ModelShape:
    return plan.ModelShape(layers=24, hidden=2048, heads=16, vocab=50257, seq=seq, micro_batch=1)


def test_auto_picks_flow_for_long_sequences_only():
    gh200 = plan.profiles.get("gh200")
    short = choose_weights(gpt_1b3(1024), gh200)
    long = choose_weights(gpt_1b3(16384), gh200)
    assert short.policy == "stationary" and long.policy == "flow"
    # the reasons carry the cost model's numbers: compute grows with seq, the fetch does not
    assert long.efficiency >= 0.98 and long.activation_bytes > 4 * 1.3e9
    assert "activations" in long.reason and "both fit" in long.reason
    assert short.activation_bytes < long.activation_bytes / 10
    # a device too small for every weight + gradient + activations: flow, since it fits
    capped = choose_weights(gpt_1b3(16384), gh200, device_memory_bytes=14e9)
    assert capped.policy == "flow" and "weight-stationary does not fit" in capped.reason
    assert capped.stationary_device_bytes > 14e9 * 0.95 > capped.flow_device_bytes
    # a slow link exposes the fetch at a short sequence: stationary, by efficiency
    slow = gh200.replace(h2d_gbps=1.0)
    assert choose_weights(gpt_1b3(2048), slow).policy == "stationary"
    assert "efficiency" in choose_weights(gpt_1b3(2048), slow).reason


def test_choose_weights_rejects_bad_input():
    with pytest.raises(TypeError, match="ModelShape"):
        choose_weights("gpt", plan.profiles.get("gh200"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_memory_bytes"):
        choose_weights(gpt_1b3(128), plan.profiles.get("gh200"), device_memory_bytes=0)


# ----------------------------------------------------------------------------- engine, auto
def tiny_gpt(n_layer: int = 4, seq: int = 64, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_tiny(n_layer=n_layer, block_size=seq, **kw)).to(torch.bfloat16)


def lm_batch(mb: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (mb, seq), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, 1)


def test_engine_auto_decides_from_the_first_batch():
    # a device budget between what weight-flow and weight-stationary need for the long batch
    prof = plan.profiles.get("gh200")
    long_shape = plan.ModelShape.from_module(tiny_gpt(), seq=64, micro_batch=16,
                                             activation_checkpointing=False)
    config = so.OffloadConfig(device="cpu", weights="auto", bucket_bytes=16384, cpu_threads=1)
    probe = choose_weights(long_shape, prof, config)
    budget = int((probe.flow_device_bytes + probe.stationary_device_bytes) / 2 / 0.95)
    chosen = {}
    for mb, seq in ((1, 8), (16, 64)):
        model = tiny_gpt()
        with so.initialize(model, dict(HYPER), config, profile=prof,
                           device_budget_bytes=budget) as engine:
            x, y = lm_batch(mb, seq)
            for _ in range(2):
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            chosen[seq] = engine.weights.active
            notes = [n.text for n in engine.telemetry.notes() if "weights='auto'" in n.text]
            assert len(notes) == 1 and "predicted" in notes[0] and "gh200" in notes[0]
            assert engine.weights.choice is not None
            assert engine.weights.choice.policy == chosen[seq], notes
    assert chosen == {8: "stationary", 64: "flow"}


def test_auto_with_seq_len_given_decides_at_initialize():
    model = tiny_gpt()
    prof = plan.profiles.get("gh200")
    config = so.OffloadConfig(device="cpu", weights="auto", bucket_bytes=16384, cpu_threads=1)
    with so.initialize(model, {}, config, profile=prof, seq_len=8, micro_batch=1) as engine:
        assert engine.weights.active == "stationary" and engine.weights.flow is None
    with pytest.raises(ValueError, match="seq_len"):
        so.initialize(tiny_gpt(), {}, config, seq_len=0)


# ----------------------------------------------------------------------------- switching
def test_switch_policies_between_iterations_matches_reference():
    steps = 9
    schedule = {3: {"weights": "flow", "prefetch_depth": 1}, 5: {"prefetch_depth": 2},
                6: {"weights": "stationary"}}
    data = batches(steps)
    ref = train_reference(make_model(n_blocks=4), data, steps=steps, max_norm=0.5)
    model = make_model(n_blocks=4)
    config = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5,
                              max_grad_norm=0.5)
    with so.initialize(model, dict(HYPER), config) as engine:
        for step, (x, y) in enumerate(data):
            if step in schedule:
                engine.reconfigure(**schedule[step])
            engine.backward(model(x, y))
            if step == 5:  # a new prefetch depth re-attaches the streaming at once
                assert engine.weights.flow is not None and engine.weights.flow.depth == 2
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        flows = [s.value for s in engine.telemetry.scalars("weights_flow")]
        assert flows == [0.0] * 3 + [1.0] * 3 + [0.0] * 3
        notes = [n.text for n in engine.telemetry.notes() if n.text.startswith("weights:")]
        assert len(notes) == 3 and "stationary -> flow" in notes[0]
        assert "prefetch_depth 2" in notes[1] and "flow -> stationary" in notes[2]
        assert engine.bucket_plan.offloaded_fraction < 1.0  # back on ratio 0.5
        for p in model.parameters():
            assert p.numel() > 0  # every weight resident again
    assert max_diff(ref, got) < 1e-5


def test_switch_back_refused_when_the_budget_is_too_small():
    model = make_model(n_blocks=4)
    config = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, weights="flow")
    with so.initialize(model, {}, config, device_budget_bytes=1000) as engine:
        engine.reconfigure(weights="stationary")
        for x, y in batches(2):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        assert engine.weights.active == "flow"
        assert any("refused" in n.text for n in engine.telemetry.notes())


# ----------------------------------------------------------------------------- capacity
SEQ, MB, WIDTH, CAP = 32, 2, 128, 4_000_000
"""Simulated device of 4 MB: a GPT of width 128, batch 2 x 32 tokens, bf16, no checkpointing."""


def _trains(n_layer: int, weights: str) -> bool:
    torch.manual_seed(0)
    gpt_config = gpt_tiny(n_layer=n_layer, n_embd=WIDTH, n_head=2, block_size=SEQ)
    model = GPT(gpt_config).to(torch.bfloat16)
    config = so.OffloadConfig(device="cpu", bucket_bytes=1 << 20, cpu_threads=1, weights=weights,
                              prefetch_depth=1, ratio=1.0)
    x, y = lm_batch(MB, SEQ)
    with so.initialize(model, {}, config, inline=True) as engine:
        meter = DeviceMeter(model, limit_bytes=CAP)
        try:
            with meter.track():
                engine.backward(model(x, y))
                engine.step()
        except DeviceBudgetExceeded:
            return False
    return True


def _largest(fits) -> int:
    n = 0
    while fits(n + 1):
        n += 1
    return n


def _predicted(n_layer: int, weights: str) -> bool:
    model = GPT(gpt_tiny(n_layer=n_layer, n_embd=WIDTH, n_head=2, block_size=SEQ))
    shape = plan.ModelShape.from_module(model.to(torch.bfloat16), seq=SEQ, micro_batch=MB,
                                        activation_checkpointing=False)
    prof = plan.profiles.get("cpu-laptop").replace(device_memory_bytes=CAP / 0.95,
                                                   shared_memory=False)
    config = so.OffloadConfig(weights=weights, ratio=1.0, grad_cast="host", param_cast="host",
                              prefetch_depth=1, bucket_bytes=1 << 20)  # as _trains runs it
    return not check_fits(memory(shape, prof, resolve(shape, prof, "superoffload", config, None)),
                          prof)


def test_largest_model_under_a_device_cap_and_the_planners_prediction():
    measured = {w: _largest(lambda n, w=w: _trains(n, w)) for w in ("stationary", "flow")}
    predicted = {w: _largest(lambda n, w=w: _predicted(n, w)) for w in ("stationary", "flow")}
    # weight-flow trains a model more than twice as deep in the same device memory
    assert measured["flow"] >= 2 * measured["stationary"] >= 2
    # the planner (its device peak: weights, the gradients in flight and what autograd
    # keeps, plan/memory.py) is within one layer for stationary and two for flow on this
    # model (4 and 9 predicted, 5 and 11 measured: the planner keeps 5% headroom and adds
    # the loss's fp32 gradients, which the meter does not count; docs/weightflow.md)
    assert abs(predicted["stationary"] - measured["stationary"]) <= 1, (predicted, measured)
    assert abs(predicted["flow"] - measured["flow"]) <= 2, (predicted, measured)
