"""The planner's device figure is what the engine holds (plan/memory.py, plan/device_grads.py).

* the activation formula against what autograd really keeps for our GPT, tensor by tensor;
* the planner's kept peak (``Memory.device_kept``: the device figure less the allocator's
  transients) against the engine's ``DeviceMeter`` (weights, live gradients, saved
  activations, the GPU tail's optimizer state) for the tiny GPT at ratio 0.3, 0.7 and 1.0
  and with weight-flow: within 10%; the measured gradient peak within the rule's bound;
* the rule itself: in flight, kept, accumulating on the device or the host, streamed blocks;
* GPT-NeoX-20B on h100-pcie at seq 4096 fits the stationary schedule (it was refused,
  "needs 87 GB", while every gradient was charged resident).
"""

from __future__ import annotations

import pytest
import torch

import superoffload as so
from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.plan.device_grads import device_grads
from superoffload.plan.memory import grads_of
from superoffload.runtime.device_meter import DeviceMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

MB, SEQ = 4, 64
LAPTOP = plan.profiles.get("cpu-laptop")  # a CPU device: casts on the host, as the engine


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_tiny(**kw)).to(torch.bfloat16)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (MB, SEQ), generator=torch.Generator().manual_seed(1))
    return x, torch.roll(x, -1, 1)


def _saved_bytes(model: GPT) -> int:
    """Bytes of the distinct storages autograd keeps for one forward (weights excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x, y = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_is_what_our_gpt_keeps(checkpointing: bool) -> None:
    model = _gpt(checkpointing=checkpointing)
    shape = plan.ModelShape.from_module(model, seq=SEQ, micro_batch=MB,
                                        activation_checkpointing=checkpointing)
    assert not shape.dropout_masks  # GPTConfig.dropout = 0 is read (no masks are kept)
    measured = _saved_bytes(model)
    # the formula differs only by the norms' statistics: fp32 on CUDA (counted), the model
    # dtype on the CPU (what this run keeps): 8 B per token and norm fewer
    assert measured <= shape.saved_activation_bytes() <= 1.01 * measured


def _measure(model: GPT, cfg: OffloadConfig) -> DeviceMeter:
    x, y = _batch()
    with so.initialize(model, {}, cfg, inline=True) as engine:
        meter = DeviceMeter(model, engine=engine)
        for _ in range(2):
            with meter.track():
                engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
    return meter


CASES = [  # (label, GPT overrides, OffloadConfig fields)
    ("ratio 0.3", {}, {"ratio": 0.3}),
    ("ratio 0.7", {}, {"ratio": 0.7}),
    ("ratio 1.0", {}, {"ratio": 1.0}),
    # six blocks, two resident at a time: weight-flow streams for real
    ("weight-flow", {"n_layer": 6}, {"weights": "flow", "prefetch_depth": 1}),
]


@pytest.mark.parametrize("label, gpt, fields", CASES, ids=[c[0] for c in CASES])
def test_planner_device_figure_is_what_the_engine_holds(label: str, gpt: dict,
                                                         fields: dict) -> None:
    model = _gpt(**gpt)
    cfg = OffloadConfig(device="cpu", bucket_bytes=16384, cpu_threads=1, **fields)
    meter = _measure(model, cfg)
    shape = plan.ModelShape.from_module(model, seq=SEQ, micro_batch=MB,
                                        activation_checkpointing=False)
    res = plan.simulate(shape, LAPTOP, "superoffload", cfg)
    mem = res.memory_detail
    assert mem.device_kept is not None
    assert mem.device_kept == pytest.approx(meter.peak_bytes, rel=0.10), (label, meter.peak_parts,
                                                                          mem.device_parts)
    # the figure is the peak, not a sum: it adds the loss's transient gradients only
    assert mem.device == pytest.approx(mem.device_kept + shape.loss_transient_bytes())
    # part by part where the meter can tell: weights and the tail's state exactly
    assert mem.device_parts["weights"] == meter.peak_parts["weights"]
    assert mem.device_parts["tail_state"] == meter.peak_parts["optimizer_state"]
    # the gradients never exceed the rule's bound (tail + buckets in flight)
    bound = grads_of(shape, res.plan)
    assert 0 < meter.peak_grad_bytes <= 2 * bound.peak_numel, (meter.peak_grad_bytes, bound)


def test_the_rule_by_hand() -> None:
    hosts, tail = [100, 400, 300, 50], 1000
    g = device_grads(hosts, tail)
    assert (g.offloaded_numel, g.in_flight_numel, g.kept_numel) == (850, 850, 0)  # 3 x 400
    g = device_grads(hosts, tail, grad_buckets_in_flight=1)
    assert g.in_flight_numel == 800 and g.peak_numel == 1800 and g.carried_numel == 0
    assert g.offloaded_resident_numel(500) == 500 and g.offloaded_resident_numel(850) == 800
    kept = device_grads(hosts, tail, grad_buckets_in_flight=1, keep_device_grads=True)
    assert kept.kept_numel == 850 and kept.peak_numel == 1850 and "keep_device_grads" in kept.rule
    # accumulating on the device: every offloaded gradient stays, and is there from the
    # start of a later micro-step; on the host only the tail's carries over
    dev = device_grads(hosts, tail, grad_buckets_in_flight=1, grad_accum_steps=4)
    assert dev.kept_numel == 850 and dev.carried_numel == 1850
    assert dev.offloaded_resident_numel(0) == 850
    host = device_grads(hosts, tail, grad_buckets_in_flight=1, grad_accum_steps=4,
                        grad_accum_on="host")
    assert host.kept_numel == 0 and host.carried_numel == tail and host.peak_numel == 1800
    # weight-flow's streamed blocks leave whatever the settings
    flow = device_grads(hosts, 0, grad_buckets_in_flight=1, keep_device_grads=True,
                        streamed_numel=700)
    assert flow.kept_numel == 150 and flow.offloaded_peak_numel == 850
    with pytest.raises(ValueError, match="grad_accum_on='auto'"):
        device_grads(hosts, tail, grad_accum_on="auto")


@pytest.mark.parametrize("fields, kept", [({}, False), ({"keep_device_grads": True}, True),
                                          ({"grad_accum_steps": 4, "grad_accum_on": "device"},
                                           True),
                                          ({"grad_accum_steps": 4, "grad_accum_on": "host"},
                                           False)])
def test_kept_and_accumulated_gradients_are_charged(fields: dict, kept: bool) -> None:
    # a short sequence: the gradients, not the activations, set the peak
    shape = plan.ModelShape(layers=8, hidden=2048, heads=16, vocab=1024, seq=16)
    prof = plan.profiles.get("h100-pcie")
    base = plan.simulate(shape, prof, config=OffloadConfig(ratio=1.0))
    res = plan.simulate(shape, prof, config=OffloadConfig(ratio=1.0, **fields))
    extra = res.memory["device"] - base.memory["device"]
    in_flight = grads_of(shape, base.plan).in_flight_numel  # 3 buckets of the largest size
    if kept:  # 2 B/param of bf16 gradients resident, instead of the buckets in flight
        assert extra == pytest.approx(2 * (shape.params - in_flight), rel=0.01)
        assert res.memory_detail.device_parts["grads"] == pytest.approx(2 * shape.params,
                                                                        rel=0.01)
    else:
        assert extra == 0
    assert res.plan.keep_device_grads == fields.get("keep_device_grads", False)
    assert res.plan.grad_accum_on == fields.get("grad_accum_on", "device")


NEOX_20B = {  # EleutherAI/gpt-neox-20b config.json (huggingface.co/EleutherAI/gpt-neox-20b)
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 6144,
    "intermediate_size": 24576, "num_attention_heads": 64, "num_hidden_layers": 44,
    "vocab_size": 50432, "max_position_embeddings": 2048, "rotary_pct": 0.25,
    "tie_word_embeddings": False, "use_parallel_residual": True, "layer_norm_eps": 1e-5}


def test_gpt_neox_20b_fits_an_h100_pcie_at_seq_4096() -> None:
    shape = plan.ModelShape.from_hf_config(NEOX_20B, seq=4096)
    assert shape.params == 20_554_567_680
    prof = plan.profiles.get("h100-pcie")
    # the default rollback="auto" may keep the whole state again in the first steps (221 GB):
    # the refusal names the setting that drops the copies, and with it the model fits
    problems = plan.fit_problems(shape, prof, "superoffload", OffloadConfig(weights="stationary"))
    assert len(problems) == 1 and "rollback='inverse' keeps none" in problems[0]
    stationary = OffloadConfig(weights="stationary", rollback="inverse")
    assert plan.fit_problems(shape, prof, "superoffload", stationary) == []
    res = plan.simulate(shape, prof, "superoffload", stationary.replace(ratio=1.0))
    # every weight (41 GB) and the gradients of three 310M-element buckets (the embeddings)
    assert res.fits and res.memory["device"] < 0.7 * 76e9
    assert res.memory_detail.device_parts["weights"] == 2 * shape.params
