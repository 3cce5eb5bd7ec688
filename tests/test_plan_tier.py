"""The planner knows the storage tier (DESIGN.md §7): the host figure is the engine's own rule
(plan/storage.py through plan/memory_host.py), the simulator's storage lane by hand, weights
on the tier, the tokens that hide the tier's traffic, the fit checks, and the local tier
measured by the project's I/O engine."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from superoffload import cli, plan
from superoffload.config import OffloadConfig
from superoffload.plan import memory_host, sim_core, sim_storage, storage_presets
from superoffload.plan.grad_accum import resolve_decided
from superoffload.plan.schedule import Schedule
from superoffload.plan.storage import plan_tier
from superoffload.plan.tier_budget import tier_config, tier_cost
from superoffload.runtime.casting import cast_policy
from superoffload.runtime.tier_open import element_bytes
from superoffload.telemetry import events as ev

PCIE = storage_presets.with_tier(plan.profiles.get("h100-pcie"), storage_presets.nvme(1, "gen4"))
SHAPE = plan.ModelShape(layers=4, hidden=1024, heads=8, vocab=32000, seq=1024)
TIER = OffloadConfig(storage_path="/tier", bucket_bytes=8 << 20, ratio=1.0, grad_cast="host",
                     param_cast="host")


def _resolved(cfg: OffloadConfig, shape: plan.ModelShape = SHAPE, prof=PCIE):
    return resolve_decided(shape, prof, "superoffload", cfg, None)


@pytest.mark.parametrize("dtype, grad, param, moments, weights, accum", list(itertools.product(
    ("bfloat16", "float32"), ("host", "device"), ("host", "device"), ("fp32", "bf16"),
    ("stationary", "flow"), ("device", "host"))))
def test_element_bytes_are_what_the_engine_allocates(dtype, grad, param, moments, weights,
                                                     accum) -> None:
    cfg = OffloadConfig(grad_cast=grad, param_cast=param, optimizer_state_dtype=moments,
                        weights=weights, grad_accum_steps=2, grad_accum_on=accum,
                        rollback="snapshot")
    res = _resolved(cfg, SHAPE.replace(dtype=dtype))
    sched = Schedule(weights=res.weights, requested_ratio=res.ratio, ratio=res.ratio,
                     bucket_plan=res.bucket_plan, grad_cast=res.grad_cast,
                     param_cast=res.param_cast, threads=res.threads, dp=1)
    cast = cast_policy(sched, getattr(torch, dtype), accum_on_host=res.grad_accum_on == "host")
    moment_dtype = torch.float32 if moments == "fp32" else torch.bfloat16
    engine = element_bytes(cast, moment_dtype, snapshot=True, flow=res.weights == "flow")
    assert memory_host.element_of(res) == engine


@pytest.mark.parametrize("cfg", [
    OffloadConfig(ratio=0.5), TIER, TIER.replace(host_memory_budget_bytes=2_500_000_000),
    TIER.replace(weights="flow"), OffloadConfig(rollback="snapshot", ratio=0.7)])
def test_the_host_figure_is_the_engines_rule(cfg: OffloadConfig) -> None:
    res = _resolved(cfg)
    want = plan_tier(list(res.bucket_plan.host_buckets), memory_host.element_of(res),
                     storage=cfg.storage_path is not None,
                     budget_bytes=cfg.host_memory_budget_bytes,
                     buffer_count=cfg.storage_buffer_count)
    mem = plan.memory(SHAPE, PCIE, res)
    assert mem.host_parts == {k: float(v) for k, v in want.host_parts.items() if v}
    assert mem.host == want.host_bytes
    assert mem.storage == want.file_bytes


def test_a_budget_that_cannot_hold_the_pool_does_not_fit() -> None:
    res = plan.simulate(SHAPE, PCIE, config=TIER.replace(host_memory_budget_bytes=1_000_000))
    assert not res.fits
    assert any("host_memory_budget_bytes=1,000,000" in p for p in res.problems)


def test_the_tier_must_hold_the_files() -> None:
    small = PCIE.replace(storage_bytes=1e6)
    res = plan.simulate(SHAPE, small, config=TIER)
    assert not res.fits and any("on the storage tier" in p for p in res.problems)
    with pytest.raises(ValueError, match="no storage tier"):
        plan.simulate(SHAPE, plan.profiles.get("h100-pcie"), config=TIER)


def _spans(res, kind: str, it: int):
    return sorted((s for s in res.timeline if s.kind == kind and s.iteration == it),
                  key=lambda s: s.start_s)


def test_the_storage_lane_by_hand_with_one_slot() -> None:
    res = plan.simulate(SHAPE, PCIE, config=TIER.replace(storage_buffer_count=1))
    tier = memory_host.host_side(SHAPE, res.plan).tier
    assert tier is not None and len(tier.tier) == len(res.plan.bucket_plan.host_buckets)
    it = res.timeline[-1].iteration - 1
    reads, writes = _spans(res, ev.KIND_TIER_READ, it), _spans(res, ev.KIND_TIER_WRITE, it)
    steps = {s.bucket: s for s in _spans(res, ev.KIND_CPU_STEP, it)}
    d2h = {s.bucket: s for s in _spans(res, ev.KIND_D2H, it)}
    read_bps, write_bps = 6.4e9, 3.8e9  # one Gen4 drive (plan/storage_presets.py)
    for r in tier.regions:
        read = next(s for s in reads if s.bucket == r.bucket)
        write = next(s for s in writes if s.bucket == r.bucket)
        assert read.nbytes == r.state_bytes  # speculation: the state in force only
        assert read.duration_s == pytest.approx(r.state_bytes / read_bps)
        assert write.nbytes == r.state_bytes + r.grad_bytes  # new state + the gradient
        assert write.duration_s == pytest.approx((r.state_bytes + r.grad_bytes) / write_bps)
        step = steps[r.bucket]
        assert step.start_s >= max(read.end_s, d2h[r.bucket].end_s) - 1e-12
        assert write.start_s >= step.end_s - 1e-12
    # one slot: a bucket's read and D2H wait for the previous bucket's write-back
    for prev, nxt in itertools.pairwise(tier.regions):
        w = next(s for s in writes if s.bucket == prev.bucket)
        assert next(s for s in reads if s.bucket == nxt.bucket).start_s >= w.end_s - 1e-12
        assert d2h[nxt.bucket].start_s >= w.end_s - 1e-12
    # reads and writes share the lane: no two of its spans overlap
    lane = sorted(reads + writes, key=lambda s: s.start_s)
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in itertools.pairwise(lane))


def test_more_slots_read_ahead_and_a_storage_bound_step_takes_the_io_time() -> None:
    one = plan.simulate(SHAPE, PCIE, config=TIER.replace(storage_buffer_count=1))
    four = plan.simulate(SHAPE, PCIE, config=TIER.replace(storage_buffer_count=4))
    assert four.iteration_s < one.iteration_s
    cost = tier_cost(SHAPE, PCIE, four.plan)
    assert cost is not None
    # the drives carry every byte once per step; nothing else binds here
    assert four.lanes[ev.LANE_STORAGE].busy_s == pytest.approx(cost.io_s, rel=1e-9)
    assert cost.io_s * (1 - 1e-9) <= four.steady_iteration_s < 1.2 * cost.io_s
    slow = plan.simulate(SHAPE, PCIE.replace(storage_read_gbps=0.64, storage_write_gbps=0.38),
                         config=TIER)
    assert slow.steady_iteration_s == pytest.approx(10 * cost.io_s, rel=0.05)


def test_the_queue_depth_scales_the_rates() -> None:
    full = tier_cost(SHAPE, PCIE, _resolved(TIER))
    half = tier_cost(SHAPE, PCIE, _resolved(TIER.replace(storage_queue_depth=2)))
    assert PCIE.storage_queue_depth == 4  # 4 requests per drive (plan/storage_presets.py)
    assert full is not None and half is not None
    assert half.io_s == pytest.approx(2 * full.io_s)


def test_tokens_per_step_that_hide_the_tier() -> None:
    cost = tier_cost(SHAPE, PCIE, _resolved(TIER))
    assert cost is not None and not cost.hidden
    assert cost.tokens_per_step == SHAPE.seq * SHAPE.micro_batch
    assert cost.tokens_needed * cost.compute_s_per_token >= cost.io_s
    assert (cost.tokens_needed - 1) * cost.compute_s_per_token < cost.io_s
    big = SHAPE.replace(micro_batch=cost.tokens_needed // SHAPE.seq + 1)
    again = tier_cost(big, PCIE, _resolved(TIER, big))
    assert again is not None and again.hidden


def test_nothing_on_the_tier_when_the_budget_holds_everything() -> None:
    cfg = OffloadConfig().replace(**tier_config(SHAPE, PCIE))
    res = plan.simulate(SHAPE, PCIE, config=cfg)
    assert res.memory["storage"] == 0 and tier_cost(SHAPE, PCIE, res.plan) is None
    assert not [s for s in res.timeline if s.lane == ev.LANE_STORAGE]
    assert res.iteration_s == pytest.approx(plan.simulate(SHAPE, PCIE, config=OffloadConfig(
        ratio=cfg.ratio)).iteration_s)
    # one memory pool: no budget, everything offloaded goes to the tier
    pool = plan.profiles.get("mi300a")
    assert tier_config(SHAPE, pool)["host_memory_budget_bytes"] is None


def test_weights_on_the_tier_when_the_budget_cannot_hold_their_homes() -> None:
    shape = SHAPE.replace(layers=8, vocab=4000)  # buckets of one block's matrices at most
    flow = TIER.replace(weights="flow", prefetch_depth=1)
    free = plan.memory(shape, PCIE, _resolved(flow, shape))  # every bucket on the tier
    homes = free.host_parts["weight_flow_homes"]
    assert homes > 0 and free.storage > 0
    tight = flow.replace(host_memory_budget_bytes=int(free.host - homes / 3))
    res = plan.simulate(shape, PCIE, config=tight)
    assert res.fits, res.problems
    tier = memory_host.host_side(shape, res.plan).tier
    assert tier is not None and 0 < len(tier.file_homes) < len(tier.tier)
    # "auto" files the homes of the buckets backward finishes first: the first ids
    assert tier.file_homes == tier.tier[:len(tier.file_homes)]
    parts = res.memory_detail.host_parts
    assert parts["weight_stage_buffers"] == tier.stage[0] * tier.stage[1] > 0
    assert res.memory["host"] <= tight.host_memory_budget_bytes
    # a fetch reads its layer's homes in the file before forward and again before backward
    per_layer = memory_host.file_home_numel(shape, res.plan, tier) * 2
    it = res.timeline[-1].iteration - 1
    fetch_reads = [s for s in _spans(res, ev.KIND_TIER_READ, it) if s.bucket == -1]
    assert len(fetch_reads) == 2 * int((per_layer > 0).sum())
    assert sorted(s.nbytes for s in fetch_reads) == sorted(
        int(x) for x in per_layer[per_layer > 0] for _ in range(2))
    cost = tier_cost(shape, PCIE, res.plan)
    assert cost is not None
    state = sum(r.state_bytes for r in tier.regions)
    assert cost.read_bytes == state + 2 * tier.home_bytes(2)
    # with room for every home, none is filed
    roomy = plan.simulate(shape, PCIE, config=flow.replace(host_memory_budget_bytes=int(free.host)))
    side = memory_host.host_side(shape, roomy.plan)
    assert side.tier is not None and side.tier.file_homes == ()


def test_the_tier_appears_in_the_lanes_and_the_summary() -> None:
    res = plan.simulate(SHAPE, PCIE, config=TIER)
    assert res.lanes[ev.LANE_STORAGE].busy_s > 0
    assert res.summary()["memory"]["storage"] == res.memory["storage"] > 0
    kinds = {s.kind for s in res.timeline if s.lane == ev.LANE_STORAGE}
    assert kinds == {ev.KIND_TIER_READ, ev.KIND_TIER_WRITE}


def test_a_clipped_step_reads_the_tier_state_back_for_its_replay() -> None:
    # a tier fast enough that buckets are stepped before validation (speculated)
    fast = storage_presets.with_tier(plan.profiles.get("h100-pcie"),
                                     storage_presets.nvme(8, "gen5"))
    shape = SHAPE.replace(seq=4096, micro_batch=8)
    res = _resolved(TIER.replace(storage_buffer_count=8), shape, fast)
    tier = memory_host.host_side(shape, res).tier
    assert tier is not None
    _, chunks = sim_core.run_timeline(shape, fast, res, 4, 2)
    spans = {kind: (s, e) for lane, kind, s, e, it, *_ in chunks
             if it == 2 and kind in (ev.KIND_ROLLBACK, ev.KIND_REPLAY, ev.KIND_VALIDATE)}
    (rb_s,), (rb_e,) = spans[ev.KIND_ROLLBACK]
    (rp_s,), (rp_e,) = spans[ev.KIND_REPLAY]
    (v_s,), _ = spans[ev.KIND_VALIDATE]
    steps = next(c for c in chunks if c[1] == ev.KIND_CPU_STEP and c[4] == 2)
    spec = {int(b) for b, st in zip(steps[5], steps[2]) if st < v_s}
    assert spec  # some buckets were speculated
    assert rb_e == rb_s  # on the tier a rollback is the version not made current: no undo
    back = sum(r.state_bytes + r.grad_bytes for r in tier.regions if r.bucket in spec)
    assert rp_e >= rb_s + back / (8 * 13e9) - 1e-12  # the replay read the state back first


def test_the_tuner_uses_the_tier_when_asked() -> None:
    shape = SHAPE.replace(layers=8, vocab=4000)  # 105M parameters: 1.68 GB of host state
    host = PCIE.replace(host_memory_bytes=1e9, device_memory_bytes=1e9)
    with pytest.raises(plan.InfeasibleError, match="host memory"):
        plan.tune(shape, host)
    cfg, why, res = plan.tune(shape, host, plan.Constraints(storage=True))
    assert res.fits and res.memory["storage"] > 0
    assert cfg.storage_path == tier_config(shape, host)["storage_path"]
    assert cfg.host_memory_budget_bytes == int(0.9 * 1e9) >= res.memory["host"]
    with pytest.raises(plan.InfeasibleError, match="no storage tier"):
        plan.tune(SHAPE, plan.profiles.get("h100-pcie"), plan.Constraints(storage=True))


def test_the_lane_places_a_job_in_the_first_gap() -> None:
    lane = sim_storage.StorageLane()
    assert lane.place(0.0, 1.0) == (0.0, 1.0)
    assert lane.place(3.0, 1.0) == (3.0, 4.0)
    assert lane.place(0.5, 1.0) == (1.0, 2.0)  # the gap 1..3 holds it
    assert lane.place(0.5, 2.0) == (4.0, 6.0)  # 2..3 is too short
    assert lane.place(10.0, 1.0) == (10.0, 11.0)


def test_the_plan_command_prints_three_tiers_and_the_tokens(capsys) -> None:
    assert cli.main(["plan", "--hf-config", "llama-3.1-70b", "--profile", "h200-pcie-measured",
                     "--storage", "nvme-gen4x4"]) == 0
    out = capsys.readouterr().out
    assert "storage GB" in out and "superoffload + storage" in out
    line = next(x for x in out.splitlines() if x.startswith("superoffload + storage:"))
    assert "tokens per step" in line and "NOT hidden" in line
    assert "storage 15.36 TB at 25.6 GB/s read / 15.2 write" in out


def test_the_local_tier_is_measured_by_the_projects_io_engine(tmp_path, capsys) -> None:
    pytest.importorskip("superoffload.storage", reason="the project's I/O engine")
    from superoffload.plan.measure_storage import measure_storage_tier

    fields = measure_storage_tier(tmp_path, size_bytes=8 << 20)
    prof = storage_presets.with_tier(plan.profiles.get("cpu-laptop"), fields)
    assert prof.has_storage and prof.storage_queue_depth == OffloadConfig().storage_queue_depth
    assert prof.provenance("storage_read_gbps") == prof.provenance("storage_bytes") == "measured"
    assert "superoffload.storage.measure_storage" in prof.source("storage_write_gbps")
    assert not list(tmp_path.iterdir())  # the scratch file is gone
    import shutil

    free = shutil.disk_usage(tmp_path).free  # the tier's capacity: the folder's free space
    assert prof.storage_bytes == pytest.approx(free, rel=0.1)
    with pytest.raises(ValueError, match="no such folder"):
        measure_storage_tier(tmp_path / "missing")
    assert cli.main(["plan", "--hf-config", "gpt2", "--profile", "cpu-laptop", "--storage",
                     f"measure:{tmp_path}", "--json"]) == 0
    share = json.loads(capsys.readouterr().out)["host_share"]
    assert share["storage"]["name"].startswith(str(tmp_path))
    assert cli.main(["plan", "--hf-config", "gpt2", "--storage", "nvme-gen9x4"]) == 2
    assert "nvme-gen4x4" in capsys.readouterr().err


def test_measure_local_measures_the_tier_it_is_given(tmp_path) -> None:
    pytest.importorskip("superoffload.storage", reason="the project's I/O engine")
    import dataclasses
    import socket

    from superoffload.plan import measure

    cached = dataclasses.replace(plan.profiles.get("cpu-laptop"),
                                 extra={"format": measure.PROFILE_FORMAT})
    (tmp_path / f"profile-{socket.gethostname()}-quick.json").write_text(
        json.dumps(cached.to_dict()))  # measure_local's cache: nothing else is measured
    folder = tmp_path / "tier"
    folder.mkdir()
    prof = plan.measure_local(quick=True, cache=tmp_path, progress=False, storage=folder)
    assert prof.has_storage and prof.provenance("storage_write_gbps") == "measured"
    assert not plan.measure_local(quick=True, cache=tmp_path, progress=False).has_storage


def test_a_fetch_waits_for_its_homes_read() -> None:
    from superoffload.plan import compute, sim_walk

    res = _resolved(TIER.replace(weights="flow"))
    lay = sim_walk.layout(SHAPE, res)
    fetched = lay.has_off & (lay.p > 0)
    slow = 1e9  # 1 GB/s: each read longer than the H2D it feeds
    tier = sim_walk.TierReads(2.0 * lay.p * fetched, sim_storage.StorageLane(), slow)
    fwd, bwd = compute.layer_times(SHAPE, PCIE)
    _, _, _, chunks = sim_walk.layer_walk(lay, res, PCIE, fwd, bwd, 0, 0.0, 0.0,
                                          np.zeros(len(lay.numel)), 0.0, fetched, 2.0, tier)
    by_kind = {kind: (s, e) for _, kind, s, e, *_ in chunks}
    read_s, read_e = by_kind[ev.KIND_TIER_READ]
    fetch_s, _ = by_kind[ev.KIND_WEIGHT_FETCH]
    assert len(read_s) == len(fetch_s) == 2 * int(fetched.sum())  # forward and backward
    assert all(f >= e - 1e-12 for f, e in zip(fetch_s, read_e))
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(read_s))  # one lane, in order
