"""The planner's data parallel is what ``FsdpOffloadEngine`` runs (plan/fsdp_units.py,
plan/sim_fsdp.py, plan/memory_fsdp.py).

* the unit rule by hand (``group_blocks``, ``block_units``; ``shard_model`` calls the same);
* the planner's FSDP2 units and the buckets each holds equal the engine's: the engine built
  on one gloo rank in this process (as tests/test_fsdp_dp.py's bit-identity test does) and
  its units read back, for grouped blocks, one block per unit, a one-unit model and
  weight-flow;
* on 2 gloo ranks (tests/_fsdp_dp_worker.py "plan", tests/_fsdp_meter.py): the all-gathers
  and reduce-scatters one optimizer step issues, counted in the engine's guarded collectives
  (distributed/fsdp/comm.py), equal the planner's count; each rank's peak device bytes
  (``DeviceMeter`` plus FSDP2's unsharded weights and gradients and its reduce-scatter
  buffer) equal the planner's ``device_kept`` within 10%, for the tiny GPT at the batch of
  tests/test_plan_device_memory.py (activations weigh most) and at a one-sequence batch
  (weights and gradients weigh most).
Times are not tested (benchmarks/bench_fsdp_engine.py prints predicted beside measured).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_support import run_ranks

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.plan.fsdp_units import block_units, group_blocks

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

WORKER = Path(__file__).with_name("_fsdp_dp_worker.py")
LAPTOP = plan.profiles.get("cpu-laptop")  # a CPU device: gloo, as the engine runs here
BASE: dict[str, Any] = {"device": "cpu", "bucket_bytes": 16384, "cpu_threads": 1,
                        "telemetry": False}


def _gpt(**kw: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_tiny(**kw)).to(torch.bfloat16)


def _predict(run: dict[str, Any]) -> plan.SimResult:
    """The planner's simulation of ``run`` on one of 2 ranks."""
    shape = plan.ModelShape.from_module(_gpt(**run.get("gpt", {})), seq=run["seq"],
                                        micro_batch=run["micro_batch"],
                                        activation_checkpointing=False)
    return plan.simulate(shape.replace(dp=2), LAPTOP, "superoffload",
                         OffloadConfig(**run["config"]))


# ---------------------------------------------------------------- the rule, pure
def test_units_rule_by_hand() -> None:
    # blocks of 5, 3, 4, 6 parameters, 10 per bucket: filled from the last block
    assert group_blocks([5, 3, 4, 6], 10) == [[0, 1], [2, 3]]
    assert group_blocks([5, 3, 4, 11], 10) == [[0], [1, 2], [3]]  # a big block alone
    stationary = block_units([5, 3, 4, 6], 30, bucket_bytes=40, weights="stationary")
    assert stationary.groups == ((0, 1), (2, 3)) and not stationary.on_host
    assert not stationary.reshard_after_forward  # one all-gather per unit and iteration
    # a model whose parameters fit one bucket: the root is the only unit
    assert block_units([5, 3], 8, bucket_bytes=32, weights="stationary").groups == ()
    flow = block_units([5, 3, 4], 12, bucket_bytes=1 << 20, weights="flow")
    assert flow.groups == ((0,), (1,), (2,)) and flow.on_host and flow.reshard_after_forward
    with pytest.raises(ValueError, match="weights='auto'"):
        block_units([5], 5, bucket_bytes=40, weights="auto")


def test_collective_counts_by_hand() -> None:
    shape = plan.ModelShape.from_module(_gpt(n_layer=4), seq=8, micro_batch=1,
                                        activation_checkpointing=False).replace(dp=2)
    flow = plan.simulate(shape, LAPTOP, config=OffloadConfig(**BASE, weights="flow")).plan
    assert flow.units is not None and len(flow.units.units) == 5  # the root + 4 blocks
    assert flow.units.collectives() == (1 + 2 * 4, 5)  # each block gathered twice
    # two micro-steps: gathered every micro-step; reduced on the last only, or every one
    assert flow.units.collectives(micro_steps=2) == (18, 5)
    assert flow.units.collectives(micro_steps=2, reduce_every_micro_step=True) == (18, 10)


def test_buckets_per_unit_follow_the_units() -> None:
    """The rule book's alternative (EngineVariant.buckets_per_unit): no bucket crosses a unit,
    every parameter in one bucket, ids in FSDP2's reduce order (the root's buckets last, so
    earliest-deadline-first steps them first), the same from the engine's units as given
    (ScheduleFacts.units) as from the blocks; off, or at dp=1, the buckets are plan_buckets'."""
    import dataclasses

    from superoffload.plan.schedule import ENGINE, ScheduleFacts, resolve_schedule

    shape = plan.ModelShape.from_module(_gpt(n_layer=4), seq=8, micro_batch=1,
                                        activation_checkpointing=False)
    cfg = OffloadConfig(**BASE, ratio=0.5)
    per_unit = dataclasses.replace(ENGINE, buckets_per_unit=True)
    facts = ScheduleFacts(params=shape.param_specs(), model_dtype="bfloat16", device_type="cpu",
                          dp=2, blocks=shape.block_of_params(), engine=per_unit)
    rules = resolve_schedule(cfg, facts)
    units = rules.units
    assert units is not None and len(units.units) == 5
    unit_of = units.unit_of()
    ids = [i for b in rules.bucket_plan.buckets for i in b.param_indices]
    assert sorted(ids) == [s.index for s in shape.param_specs()]  # each parameter once
    order = [unit_of[b.param_indices[0]] for b in rules.bucket_plan.buckets]
    for b in rules.bucket_plan.buckets:
        assert len({unit_of[i] for i in b.param_indices}) == 1  # within one unit
    assert order == sorted(order, key=lambda u: (u == 0, -u))  # last block first, root last
    assert all(len(units.buckets_of()[b]) == 1 for b in units.buckets_of())
    assert 0.4 < rules.bucket_plan.offloaded_fraction < 0.6  # ratio 0.5 to whole buckets
    given = dataclasses.replace(facts, blocks=None,
                                units=tuple(u.param_indices for u in units.units))
    assert resolve_schedule(cfg, given).bucket_table() == rules.bucket_table()
    today = resolve_schedule(cfg, dataclasses.replace(facts, engine=ENGINE))
    one = resolve_schedule(cfg, dataclasses.replace(facts, dp=1))
    assert today.bucket_table() == one.bucket_table() != rules.bucket_table()
    assert any(len(bs) > 1 for bs in today.units.buckets_of().values())  # some cross units


# ---------------------------------------------------------------- the engine's units
TABLE_CASES = {  # name: (GPT overrides, OffloadConfig fields)
    "one block per unit": ({}, {}),
    "blocks grouped": ({"n_layer": 6, "n_embd": 32}, {"bucket_bytes": 4 * 30_000}),
    "one unit": ({}, {"bucket_bytes": 1 << 20}),
    "weight-flow": ({"n_layer": 3}, {"weights": "flow", "ratio": 0.5}),
}


def test_planner_units_and_buckets_are_the_engines() -> None:
    from superoffload.distributed import init_distributed, shutdown
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        sizes = set()
        for name, (gpt, fields) in TABLE_CASES.items():
            fields = {**BASE, "ratio": 0.7, **fields}
            cfg = OffloadConfig(**fields)
            res = _predict({"gpt": gpt, "config": fields, "seq": 16, "micro_batch": 1})
            model = _gpt(**gpt)
            with FsdpOffloadEngine(model, {"lr": 1e-3}, cfg, inline=True) as engine:
                index = {id(p): i for i, p in enumerate(engine.state.params)}
                bucket_of = engine.state.bucket_of
                flow = engine.weights.flow
                host = {id(m) for m in (flow.blocks if flow is not None else [])}
                got = []
                for k, u in enumerate(engine.units):
                    ids = tuple(sorted(index[id(p)] for p in u.params))
                    got.append((k, ids, sum(p.numel() for p in u.params),
                                any(id(m) in host for m in u.modules),
                                tuple(sorted({bucket_of[i] for i in ids}))))
                table = engine.schedule.bucket_table()
            units = res.plan.units
            assert units is not None, name
            want = [(i, tuple(sorted(p)), n, h, b) for i, p, n, h, _, b in units.table()]
            assert got == want, name
            assert table == [(b.id, b.param_indices, b.numel, b.on_device)
                             for b in res.plan.bucket_plan.buckets], name
            sizes.add(len(units.units))
        assert sizes == {1, 3, 4}  # the root alone, root + 2 or 3 block units
    finally:
        shutdown()


# ---------------------------------------------------------------- 2 ranks
ACT = {"micro_batch": 4, "seq": 64}  # tests/test_plan_device_memory.py's batch
ONE = {"micro_batch": 1, "seq": 8}  # weights and gradients weigh most
RUNS: dict[str, dict[str, Any]] = {
    "ratio 0.3": {**ACT, "config": {**BASE, "ratio": 0.3}},
    "ratio 1.0": {**ACT, "config": {**BASE, "ratio": 1.0}},
    "one unit": {**ACT, "config": {**BASE, "ratio": 0.7, "bucket_bytes": 1 << 20}},
    # six blocks, each its own unit on the host, gathered for forward and again for backward
    "weight-flow": {**ACT, "gpt": {"n_layer": 6},
                    "config": {**BASE, "weights": "flow", "prefetch_depth": 1}},
    "accumulate on the device": {**ACT, "config": {**BASE, "ratio": 1.0, "grad_accum_steps": 2,
                                                   "grad_accum_on": "device"}},
    "accumulate on the host": {**ACT, "config": {**BASE, "ratio": 0.5, "grad_accum_steps": 2,
                                                 "grad_accum_on": "host"}},
    "one sequence, ratio 0.5": {**ONE, "config": {**BASE, "ratio": 0.5}},
    "one sequence, one unit": {**ONE, "config": {**BASE, "ratio": 0.5,
                                                 "bucket_bytes": 1 << 20}},
    "one sequence, accumulate on the device": {**ONE, "config": {
        **BASE, "ratio": 1.0, "grad_accum_steps": 2, "grad_accum_on": "device"}},
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("plan_fsdp")
    results = run_ranks("plan", 2, out, timeout_s=600, args={"runs": RUNS}, worker=WORKER)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"
    return [json.loads((out / f"plan_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("name", list(RUNS))
def test_collectives_per_step_are_counted_as_predicted(measured: list, name: str) -> None:
    cfg = OffloadConfig(**RUNS[name]["config"])
    units = _predict(RUNS[name]).plan.units
    assert units is not None
    want = units.collectives(micro_steps=cfg.grad_accum_steps,
                             reduce_every_micro_step=cfg.grad_accum_on == "host")
    for rank in range(2):
        got = measured[rank][name]["counts"]
        assert (got["all_gather"], got["reduce_scatter"]) == want, (rank, got)


@pytest.mark.parametrize("name", list(RUNS))
def test_device_memory_per_rank_is_what_the_engine_holds(measured: list, name: str) -> None:
    res = _predict(RUNS[name])
    mem = res.memory_detail
    assert mem.device_kept is not None
    for rank in range(2):
        got = measured[rank][name]
        assert mem.device_kept == pytest.approx(got["peak"], rel=0.10), (
            rank, got, mem.device_parts)
