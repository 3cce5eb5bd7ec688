"""One rule book (planner side): the planner simulates the schedule the engine runs.

For a small bf16 GPT, the planner's effective ratio, offloaded bytes and bucket table equal what
``plan.schedule.resolve_schedule`` gives for the module's real parameters (as the engine builds
its ParamSpecs from ``named_parameters``), for weight-stationary, weight-flow, dp=2 and
dp=2 + weight-flow; and the parameter list of a shape built from numbers is the one
``ModelShape.from_module`` records for our GPT.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.models.gpt import GPT, GPTConfig
from superoffload.plan.buckets import ParamSpec
from superoffload.plan.schedule import (
    ENGINE,
    ENGINE_H200_MEASURED,
    EngineVariant,
    ScheduleFacts,
    engine_for,
    resolve_schedule,
)
from superoffload.telemetry import events as ev

PCIE = plan.profiles.get("h200-pcie-measured")
CFG = OffloadConfig(bucket_bytes=64 * 1024, ratio=0.5, grad_cast="host", param_cast="host")


def _gpt(n_layer: int = 3, n_embd: int = 64, block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size)
               ).to(torch.bfloat16)


def _engine_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """The engine's list (runtime/engine.py: index over named_parameters, trainable only)."""
    return [ParamSpec(i, p.numel(), True, n) for i, (n, p) in enumerate(model.named_parameters())
            if p.requires_grad]


@pytest.mark.parametrize("weights, dp", [("stationary", 1), ("flow", 1), ("stationary", 2),
                                         ("flow", 2)])
def test_planner_runs_the_engines_schedule(weights: str, dp: int) -> None:
    model = _gpt()
    cfg = CFG.replace(weights=weights)
    shape = plan.ModelShape.from_module(model, seq=32, micro_batch=2).replace(dp=dp)
    res = plan.simulate(shape, PCIE, "superoffload", cfg)
    facts = ScheduleFacts(params=tuple(_engine_specs(model)), model_dtype="bfloat16",
                          device_type="cuda", dp=dp, usable_cores=PCIE.cpu_cores, profile=PCIE)
    rules = resolve_schedule(cfg, facts)
    # the effective ratio: weight-flow offloads everything, with or without data parallel
    assert res.plan.ratio == rules.ratio == (1.0 if weights == "flow" else 0.5)
    assert res.plan.weights == weights  # dp > 1 no longer forces weight-stationary
    # the bucket table: whole parameters, as plan_buckets cuts the real list
    table = [(b.id, b.param_indices, b.numel, b.on_device) for b in res.plan.bucket_plan.buckets]
    assert table == rules.bucket_table()
    assert len(table) > 4 and any(len(ids) > 1 for _, ids, _, _ in table)
    assert (res.plan.grad_cast, res.plan.param_cast, res.plan.threads) == (
        rules.grad_cast, rules.param_cast, rules.threads)
    # offloaded bytes: the host's fp32 master and moments over this rank's shards (rounded
    # up, as the engine allocates them), and the gradients crossing per iteration
    host = res.memory_detail.host_parts["resident_state"]
    assert host == 12 * sum(math.ceil(b.numel / dp) for b in rules.bucket_plan.host_buckets)
    tail = res.memory_detail.device_parts["tail_state"]
    # fp32 master, m and v of the tail (its fp32 gradient temporaries are the step's, not
    # resident) over this rank's shards (FSDP2); 0 under weight-flow (was 1.22 GB of a 1.3B
    # model)
    assert tail == pytest.approx(12 * rules.device_numel / dp)
    it = res.timeline[-1].iteration
    d2h = {s.bucket: s.nbytes for s in res.timeline if s.kind == ev.KIND_D2H and s.iteration == it}
    want = {b.id: 2 * math.ceil(b.numel / dp) for b in rules.bucket_plan.host_buckets}
    assert d2h == want  # bf16 gradients of this rank's shard of each host bucket


def test_flow_ratio_is_the_effective_one_on_a_large_model() -> None:
    # weights="flow", ratio=0.5 used to predict 1.22 GB of tail state on the device while
    # the engine offloads everything; the rule book's ratio 1 leaves none
    shape = plan.ModelShape(layers=24, hidden=2048, heads=16, vocab=50257, seq=2048)
    res = plan.simulate(shape, PCIE, config=OffloadConfig(weights="flow", ratio=0.5))
    assert res.plan.requested_ratio == 0.5 and res.plan.ratio == 1.0
    assert res.memory_detail.device_parts["tail_state"] == 0
    assert not [s for s in res.timeline if s.kind == ev.KIND_DEVICE_STEP]
    assert any("weight-flow" in r for r in res.plan.reasons)


@pytest.mark.parametrize("n_layer, n_embd, block_size", [(1, 32, 8), (3, 64, 32), (2, 128, 64)])
def test_shape_from_numbers_lists_the_gpt_parameters(n_layer, n_embd, block_size) -> None:
    model = _gpt(n_layer, n_embd, block_size)
    real = plan.ModelShape.from_module(model, seq=block_size)
    synth = plan.ModelShape(layers=n_layer, hidden=n_embd, heads=4, vocab=256, seq=block_size,
                            learned_positions=True, tied_embeddings=True)
    for a, b in zip(real.param_layout(), synth.param_layout()):
        assert a.tolist() == b.tolist()
    assert real.n_param_tensors == synth.n_param_tensors == 2 + 12 * n_layer + 2
    assert [s.numel for s in real.param_specs()] == [s.numel for s in _engine_specs(model)]
    assert real.params == synth.params == model.num_params()
    assert real.layer_params() == synth.layer_params()
    assert real.dtype == "bfloat16"


def test_parameter_list_by_hand() -> None:
    # GPT-2 block of width h=64 (f=256), registration order of models/gpt.py
    shape = plan.ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq=8)
    layer, numel = shape.param_layout()
    block = [64, 64, 3 * 64 * 64, 3 * 64, 64 * 64, 64, 64, 64, 256 * 64, 256, 64 * 256, 64]
    assert numel.tolist() == [100 * 64, *block, *block, 64, 64]  # tied head: wte only
    assert layer.tolist() == [0] + [1] * 12 + [2] * 12 + [3, 3]
    assert sum(block) == shape.block_params
    untied = shape.replace(tied_embeddings=False, learned_positions=True)
    layer, numel = untied.param_layout()
    assert numel.tolist()[:2] == [100 * 64, 8 * 64] and numel.tolist()[-1] == 100 * 64
    assert int(numel.sum()) == untied.params and layer[-1] == 3


def test_frozen_and_tied_parameters_are_listed_as_the_engine_sees_them() -> None:
    model = _gpt()
    model.wpe.weight.requires_grad_(False)
    shape = plan.ModelShape.from_module(model, seq=32)
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    assert [n for _, n in shape.param_table] == trainable  # lm_head (tied) once, wpe frozen out
    assert shape.param_table[0][0] == 0 and shape.param_table[-1][0] == shape.layers + 1


def test_planner_choice_sets_are_the_configs() -> None:
    # the planner's own tuples hold the config's members (declared once, in config.py)
    from typing import get_args

    from superoffload.config import StepOrder, choices_of
    from superoffload.plan import cost, fsdp_units
    from superoffload.plan.device_grads import PLACES

    assert choices_of("grad_accum_on", decided=True) == PLACES
    assert choices_of("weights", decided=True) == fsdp_units.WEIGHT_POLICIES
    assert choices_of("optimizer_state_dtype") == cost.STATE_DTYPES
    assert sorted(cost.PARAM_CAST_PREFERENCE) == sorted(choices_of("param_cast", decided=True))
    assert all(EngineVariant(step_order=o).step_order == o for o in get_args(StepOrder))


def test_engine_variant_is_the_rule_books() -> None:
    # the default is the engine that runs, in the order the config selects,
    # as runtime/engine.py resolves it: "deadline" -> EDF, "fifo" -> FIFO
    res = plan.simulate(plan.ModelShape.from_module(_gpt(), seq=32), PCIE, config=CFG)
    assert res.plan.engine == ENGINE
    assert CFG.step_order == "deadline" and engine_for(CFG) == ENGINE
    fifo_cfg = CFG.replace(step_order="fifo")
    fifo = plan.simulate(res.shape, PCIE, config=fifo_cfg)
    assert fifo.plan.engine == engine_for(fifo_cfg) == replace(ENGINE, step_order="fifo")
    assert fifo.summary()["plan"]["engine"]["step_order"] == "fifo"
    with pytest.raises(ValueError, match="step_order='edf'"):  # the old name went in 0.2
        EngineVariant(step_order="edf")  # type: ignore[arg-type]
    # a variant given to Techniques is used as it is, whatever the config's order
    today = plan.simulate(res.shape, PCIE, config=CFG,
                          techniques=plan.Techniques(engine=ENGINE_H200_MEASURED))
    assert today.plan.engine == ENGINE_H200_MEASURED and today.plan.engine.step_order == "fifo"
    assert engine_for(fifo_cfg, ENGINE_H200_MEASURED) is ENGINE_H200_MEASURED
    with pytest.raises(ValueError, match="OffloadConfig.step_order='lifo'"):
        engine_for(OffloadConfig(step_order="lifo"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_order"):
        EngineVariant(step_order="lifo")
    with pytest.raises(ValueError, match="tail_step"):
        EngineVariant(tail_step="half")
    with pytest.raises(ValueError, match="Techniques.engine"):
        plan.Techniques(engine="edf")  # type: ignore[arg-type]


def test_device_type_comes_from_the_profile() -> None:
    laptop = plan.profiles.get("cpu-laptop")
    assert laptop.device_type == "cpu" and PCIE.device_type == "cuda"
    shape = plan.ModelShape.from_module(_gpt(), seq=32)
    auto = OffloadConfig(bucket_bytes=64 * 1024, grad_cast="auto", param_cast="auto")
    # on a CPU "device" the rule book moves fewer bytes: host casting both ways
    res = plan.simulate(shape, laptop, config=auto)
    assert (res.plan.grad_cast, res.plan.param_cast) == ("host", "host")
    # the thread rule: a GPU host keeps 2 cores for the runtime's busy threads
    assert plan.simulate(shape, PCIE, config=auto).plan.threads == min(
        math.floor(0.9 * 16), 16 - 2)
    assert res.plan.threads == math.floor(0.9 * laptop.cpu_cores)
    with pytest.raises(ValueError, match="device_type"):
        PCIE.replace(device_type="tpu")


def test_buckets_are_whole_parameters_in_the_simulated_stream() -> None:
    # a parameter larger than bucket_bytes is a bucket of its own, never cut
    shape = plan.ModelShape(layers=2, hidden=256, heads=4, vocab=1000, seq=16)
    res = plan.simulate(shape, PCIE, config=OffloadConfig(bucket_bytes=4096, ratio=1.0))
    _, numel = shape.param_layout()
    sizes = sorted(b.numel for b in res.plan.bucket_plan.buckets)
    assert max(sizes) == int(numel.max()) and min(sizes) <= 4096 // 4
    # every parameter in exactly one bucket
    members = sorted(i for b in res.plan.bucket_plan.buckets for i in b.param_indices)
    assert members == list(range(len(numel)))
    assert np.sum(sizes) == shape.params
