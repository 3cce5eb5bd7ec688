"""Data parallel in the planner: ring collectives by hand, FSDP2's per-unit collectives and
the backends, per-rank memory and fits, ranks sharing a host, dp=1 identical to the
single-rank planner, the --dp CLI (tests/test_plan_fsdp.py: the units against the engine's)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from superoffload import plan
from superoffload.cli import main
from superoffload.config import MiB, OffloadConfig
from superoffload.plan import parallel
from superoffload.plan.memory import offloaded_params
from superoffload.plan.schedule import ENGINE, ENGINE_H200_MEASURED
from superoffload.telemetry import events as ev

GH200 = plan.profiles.get("gh200")
B13: dict[str, Any] = dict(layers=40, hidden=5120, heads=40, vocab=50257, seq=4096, micro_batch=4)
SMALL: dict[str, Any] = dict(layers=8, hidden=2048, heads=16, vocab=50257, seq=2048, micro_batch=1)
HOST_CAST = OffloadConfig(grad_cast="host", param_cast="host", weights="stationary")


# Numbers of the single-rank planner, pinned so a change to dp=1 shows: (iteration_s,
# steady_iteration_s, device bytes, host bytes, spans). Re-pinned when the planner's default
# became the engine that runs (plan.schedule.ENGINE: EDF stepping, copy-first
# D2H, small buckets merged, fused tail step). Against the previous pins (ENGINE_H200_MEASURED):
# gh200 13B 2.9168 -> 2.8826 s (the tail step: 1.28B tail params x (118 - 28) B / 4 TB/s =
# 28.8 ms, and 28 x 20 - 14 x 1 launches x 10 us = 5.5 ms), 2 x 4 B x 20480 more device
# staging for the weights cast on the device (the largest host bucket now holds the MLP
# weight and its merged bias), 3872 -> 2108 spans (buckets merged); h100-pcie flow 0.1150 ->
# 0.0978 s; DeepSpeed's row unchanged (not our engine).
# The fifo row pins OffloadConfig.step_order="fifo" selecting the FIFO variant.
# Device bytes re-pinned when the device figure became the peak the engine holds
# (plan/memory.py, plan/device_grads.py): offloaded gradients leave with their bucket (at most
# 3 buckets in flight instead of 2 B/param resident), the tail keeps 12 B/param (fp32 master,
# m, v), activations are what autograd keeps placed at their moment of backward, and weight-flow
# keeps the embeddings and head resident (the engine streams the blocks only): gh200 13B
# 88.84 -> 59.41 GB, h100-pcie flow 1.857 -> 2.037 GB, DeepSpeed's row 5.103 -> 5.393 GB (its
# activations now include the loss's fp32 gradients). Times and host bytes unchanged.
# Host bytes re-pinned when the host figure became the engine's own rule (plan/storage.py via
# plan/memory_host.py): the gradient buffer is the model dtype's 2 B where gradients are cast
# on the host, and no low-precision copy is kept where weights are cast on the device: gh200
# 13B 208.13 -> 161.88 GB (18 -> 14 B/param), h100-pcie flow 9.104 -> 8.093 GB (16 + 2 -> 12 +
# 2 + 2). Times re-pinned when gh200's link became the published measurements (375 GB/s H2D,
# 297 D2H, not the 450 spec): gh200 13B 2.882590 -> 2.882614 s (the link is not its
# bottleneck), DeepSpeed's row 0.11454 -> 0.11731 s (its fp32 copies ride the compute stream).
# DeepSpeed's host bytes re-pinned when they became what it pins (plan/deepspeed.py: the fp32
# master, its gradient and the bf16 buffer rounded up to powers of two by PyTorch's pinned
# allocator): 9.310 -> 9.684 GB.
# Host bytes re-pinned when the default rollback's pre-step copies were charged (plan/storage.py
# keeps_copies: rollback="auto" keeps whole p, m, v of a speculated bucket while its moments hold
# one or two gradients, runtime/auto_rollback.py; a peak of the first steps the engine really
# reaches): the state once more, gh200 13B 161.88 -> 300.64 GB, h100-pcie flow 8.093 -> 14.16 GB.
GOLDEN = [
    ("gh200", B13, "superoffload", None,
     (2.8826140613374363, 2.880049485172309, 59409948672.0, 300637941760.0, 2108)),
    ("h100-pcie", SMALL, "superoffload", OffloadConfig(weights="flow"),
     (0.09778230219404009, 0.09774673412696161, 2037116928.0, 14162305024.0, 428)),
    ("h100-pcie", SMALL, "superoffload", OffloadConfig(weights="flow", step_order="fifo"),
     (0.11442354728494918, 0.1143879792178707, 2037116928.0, 14162305024.0, 428)),
    ("gh200", SMALL, "zero-offload", None,
     (0.11730895058349744, 0.11730895058349744, 5393365504.0, 9683517440.0, 116)),
]


@pytest.mark.parametrize("prof, shape, schedule, cfg, golden", GOLDEN)
def test_dp1_reproduces_the_single_rank_planner_exactly(prof, shape, schedule, cfg, golden) -> None:
    r = plan.simulate(plan.ModelShape(**shape, dp=1, ranks_per_host=1), plan.profiles.get(prof),
                      schedule, cfg)
    assert (r.iteration_s, r.steady_iteration_s, r.memory["device"], r.memory["host"],
            r.n_spans) == pytest.approx(golden, rel=1e-12)
    assert r.collective_s == 0.0
    assert plan.max_model_size(GH200, dp=1) == 27983681024


def test_ring_collectives_by_hand() -> None:
    # 64 MiB of fp32 gradients over 4 ranks at 50 GB/s, 10 us per ring step:
    # 3 * 10 us + 3/4 * 67108864 B / 50e9 B/s = 30 us + 1006.63296 us
    nbytes = 64 * MiB
    ring_s = pytest.approx(1.03663296e-3, rel=1e-12)
    assert parallel.reduce_scatter_time_s(nbytes, 4, GH200) == ring_s
    assert parallel.all_gather_time_s(nbytes, 4, GH200) == ring_s
    # all-reduce = reduce-scatter + all-gather: twice the steps and the bytes
    both_s = pytest.approx(2 * 1.03663296e-3, rel=1e-12)
    assert parallel.all_reduce_time_s(nbytes, 4, GH200) == both_s
    assert parallel.reduce_scatter_time_s(nbytes, 1, GH200) == 0.0
    assert parallel.reduce_scatter_time_s(0.0, 8, GH200) == 0.0
    # 2 ranks: 1 step, half the bytes cross
    assert parallel.all_gather_time_s(1e9, 2, GH200) == pytest.approx(10e-6 + 0.5 * 1e9 / 50e9)
    with pytest.raises(ValueError, match="ranks=0"):
        parallel.ring_time_s(1.0, 0, GH200)


@pytest.mark.parametrize("engine", [None, ENGINE_H200_MEASURED],
                         ids=["engine-now", "h200-measured"])
def test_simulated_bucket_spans_move_this_ranks_shard(engine) -> None:
    # ratio 1, 64 MiB buckets, bf16 both ways. The engine's buckets hold whole parameters;
    # the last block's MLP projection (5120 x 20480 = 104,857,600 params) is larger than a
    # 64 MiB bucket. Today's engine closes [ln_f.b, ln_f.w, mlp.proj.b] as bucket 0 and the
    # projection is bucket 1 alone; the engine now merges that small bucket (less than half
    # full) into the next parameter, so bucket 0 is the four of them
    cfg = HOST_CAST.replace(ratio=1.0, bucket_bytes=64 * MiB)
    r = plan.simulate(plan.ModelShape(**B13, dp=4), GH200, "superoffload", cfg,
                      plan.Techniques(engine=engine))
    proj = 5120 * 20480
    if engine is None:
        assert r.plan.engine == ENGINE
        b, numel, stats = 0, 3 * 5120 + proj, 0.0  # copy first: no stats before the D2H
    else:
        assert r.plan.bucket_plan.buckets[0].numel == 3 * 5120
        # today's D2H lane: 9 stats kernels + a host round trip (2 launches) first
        b, numel, stats = 1, proj, 11 * 10e-6
    assert r.plan.bucket_plan.buckets[b].numel == numel
    it = r.timeline[-1].iteration
    d2h = [s for s in r.timeline if s.lane == ev.LANE_D2H and s.iteration == it and s.bucket == b]
    h2d = [s for s in r.timeline if s.lane == ev.LANE_H2D and s.iteration == it and s.bucket == b]
    cpu = [s for s in r.timeline if s.lane == ev.LANE_CPU and s.kind == ev.KIND_CPU_STEP
           and s.iteration == it and s.bucket == b]
    shard = numel / 4  # params of this rank's slice (numel is a multiple of 4 here)
    # the shard's bf16 over C2C at the measured rates (375 GB/s H2D, 297 D2H)
    d2h_link, h2d_link = 20e-6 + 2 * shard / 297e9, 20e-6 + 2 * shard / 375e9
    # FSDP2 reduced the gradients and gathers the weights per unit: the lanes move the shard
    assert d2h[0].duration_s == pytest.approx(d2h_link + stats, rel=1e-9)
    assert h2d[0].duration_s == pytest.approx(h2d_link, rel=1e-9)
    assert d2h[0].nbytes == 2 * shard and cpu[0].nbytes == 28 * shard
    # CPU: 64 threads x 1e9/0.082/72 params/s, or the host bus (0.7 x 500 GB/s) carrying 32
    # B/param (26 B pass + 2 B bf16 copy, no write-allocate on Grace, 2 + 2 B of DMA)
    compute = 64 * (1e9 / 0.082 / 72)
    per_param = max(1 / compute, 32 / (0.7 * 500e9))
    assert r.plan.threads == 64
    assert cpu[0].duration_s == pytest.approx(GH200.cpu_call_s + shard * per_param, rel=1e-9)


@pytest.mark.parametrize("replicas", [1, 2])
def test_fsdp_collectives_by_hand(replicas: int) -> None:
    # B13 on GH200 at dp=4 (x 2 replicas: HSDP), 64 MiB buckets: every block (314.6 M params)
    # is larger than a bucket, so each is a unit; the root holds the embedding and ln_f. Per
    # unit one all-gather and one reduce-scatter of its bf16 weights / gradients (ring over 4
    # ranks: 3 steps of 10 us, 3/4 of the bytes at 50 GB/s); HSDP all-reduces each reduced
    # shard over the 2 replicas (2 steps, 2 x 1/2 of the shard's bytes); the validation vector
    # is 7 + one float64 per parameter, all-reduced over every rank
    cfg = HOST_CAST.replace(ratio=1.0, bucket_bytes=64 * MiB)
    shape = plan.ModelShape(**B13, dp=4, dp_replicate=replicas)
    r = plan.simulate(shape, GH200, "superoffload", cfg)
    units = r.plan.units.units
    assert len(units) == 1 + 40 and all(u.blocks == (u.index - 1,) for u in units[1:])
    assert units[0].numel == 50257 * 5120 + 2 * 5120 and units[1].numel == shape.block_params
    ring = sum(2 * (3 * 10e-6 + 0.75 * 2 * u.numel / 50e9) for u in units)
    hsdp = sum(2 * 10e-6 + 2 * 0.5 * 2 * u.numel / 4 / 50e9 for u in units) if replicas > 1 else 0
    world = 4 * replicas
    val = 2 * (world - 1) * 10e-6 + 2 * (world - 1) / world * 8 * (7 + shape.n_param_tensors) / 50e9
    assert r.collective_s == pytest.approx(ring + hsdp + val, rel=1e-9)
    assert r.collective_backend == "nccl" and r.summary()["dp_replicate"] == replicas
    # each unit's gather waits for its buckets' publishes; a bucket waits for its last unit
    assert units[0].buckets[0] == 0  # ln_f (root) shares bucket 0 with the last block
    assert r.plan.units.buckets_of()[0] == (40, 0)  # ... so it completes when the root reduces


def test_gloo_blocks_compute_and_nccl_overlaps_it() -> None:
    # the same machine numbers with a CPU device (gloo: each collective runs in the training
    # thread) and a GPU (NCCL: on its own streams): the compute lane waits through every
    # collective on gloo, and NCCL is never slower
    shape = plan.ModelShape(**SMALL, dp=4)
    cpu = GH200.replace(device_type="cpu", collective_gbps=5.0)
    gloo = plan.simulate(shape, cpu, "superoffload", HOST_CAST)
    nccl = plan.simulate(shape, cpu.replace(device_type="cuda"), "superoffload", HOST_CAST)
    assert (gloo.collective_backend, nccl.collective_backend) == ("gloo", "nccl")
    it = gloo.timeline[-1].iteration
    waits = sum(s.duration_s for s in gloo.timeline
                if s.kind == ev.KIND_WAIT and s.iteration == it)
    assert waits >= gloo.collective_s - 1e-12  # every all-gather / reduce-scatter is waited
    assert nccl.steady_iteration_s < gloo.steady_iteration_s


def test_more_ranks_never_increase_per_rank_host_memory() -> None:
    last = float("inf")
    for dp in (1, 2, 3, 4, 8, 16, 64):
        r = plan.simulate(plan.ModelShape(**B13, dp=dp), GH200, "superoffload", HOST_CAST)
        host = r.memory_detail.host_parts
        off = offloaded_params(r.shape, r.plan)
        # the engine's buffers over its shards (plan/storage.py): master, m, v 12 B, the
        # bf16 gradient buffer 2 B (cast on the host), the bf16 copy 2 B; shards rounded up
        shards = sum(-(-b.numel // dp) for b in r.plan.bucket_plan.host_buckets)
        assert host["resident_state"] == 12 * shards
        assert host["grad_buffers"] == host["lp_copies"] == 2 * shards
        assert shards == pytest.approx(off / dp, rel=1e-4)
        assert r.memory["host"] <= last
        last = r.memory["host"]
        parts = r.memory_detail.device_parts
        if dp > 1:  # FSDP2: at the peak (backward's start) every unit's unsharded bf16
            # weights are gathered (reshard_after_forward=False) besides this rank's shards
            assert parts["weights"] == pytest.approx(2 * r.shape.params * (1 + 1 / dp))


@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("schedule", ["superoffload", "zero-offload", "gpu"])
def test_invariants_hold_with_ranks(dp: int, schedule: str) -> None:
    r = plan.simulate(plan.ModelShape(**SMALL, dp=dp), GH200, schedule)
    by_lane: dict[str, list[ev.Span]] = defaultdict(list)
    for s in r.timeline:
        assert s.end_s >= s.start_s >= 0 and s.lane in ev.LANES
        if s.kind != ev.KIND_WAIT:
            by_lane[s.lane].append(s)
    for lane, spans in by_lane.items():
        spans.sort(key=lambda s: s.start_s)
        for a, b in zip(spans, spans[1:]):
            assert b.start_s >= a.end_s - 1e-12, f"{lane} overlaps itself"
    assert r.collective_s > 0
    # a slower interconnect is never faster; a free one leaves only the CPU saving of sharding
    slow = plan.simulate(r.shape, GH200.replace(collective_gbps=5.0), schedule)
    free = plan.simulate(r.shape, GH200.replace(collective_gbps=1e9, collective_latency_s=0.0),
                         schedule)
    single = plan.simulate(plan.ModelShape(**SMALL), GH200, schedule)
    assert slow.iteration_s >= r.iteration_s >= free.iteration_s - 1e-12
    assert free.iteration_s <= single.iteration_s * (1 + 1e-6)
    assert r.summary()["dp"] == dp


def test_ranks_on_one_host_split_it() -> None:
    pcie = plan.profiles.get("h100-pcie")
    share = parallel.rank_profile(pcie, 8)
    assert share.cpu_cores == 4 and share.host_memory_bytes == pcie.host_memory_bytes / 8
    assert share.host_mem_bw_gbps == pcie.host_mem_bw_gbps / 8
    assert share.h2d_gbps == pcie.h2d_gbps  # one PCIe link per GPU
    assert parallel.rank_profile(pcie, 1) is pcie
    shape: dict[str, Any] = dict(layers=24, hidden=4096, heads=32, vocab=50257, seq=2048,
                                 micro_batch=1)
    alone = plan.simulate(plan.ModelShape(**shape, dp=8), pcie, "superoffload", HOST_CAST)
    shared = plan.simulate(plan.ModelShape(**shape, dp=8, ranks_per_host=8), pcie, "superoffload",
                           HOST_CAST)
    assert shared.plan.threads < alone.plan.threads
    assert shared.lanes["cpu_optimizer"].busy_s > alone.lanes["cpu_optimizer"].busy_s
    assert shared.memory["host"] == alone.memory["host"]  # same shard, smaller share to fit in
    # 8 ranks sharing the host give the same host-side limit as one rank alone on it
    dp1 = plan.fit_problems(plan.ModelShape(**shape), pcie, "superoffload", HOST_CAST)
    dp8 = plan.fit_problems(plan.ModelShape(**shape, dp=8, ranks_per_host=8), pcie,
                            "superoffload", HOST_CAST)
    assert not dp1 and not dp8
    with pytest.raises(ValueError, match="ranks_per_host=4 exceeds dp=2"):
        plan.ModelShape(**shape, dp=2, ranks_per_host=4)


def test_host_fit_is_per_rank_share() -> None:
    # 135 GB usable; 12.8B x 18 B / 2 = 116 (no pre-step copies: the inverse rollback)
    small_host = GH200.replace(host_memory_bytes=150e9)
    shape = plan.ModelShape(**B13, dp=2)
    lean = HOST_CAST.replace(ratio=1.0, rollback="inverse")
    assert not plan.fit_problems(shape, small_host, "superoffload", lean)
    crowded = shape.replace(ranks_per_host=2)  # two ranks in 150 GB: 67.5 usable each, not enough
    problems = plan.fit_problems(crowded, small_host, "superoffload", lean)
    assert problems and "host memory" in problems[0]
    # the default rollback's copies of the first steps (the state again) do not fit one rank
    copies = plan.fit_problems(shape, small_host, "superoffload", HOST_CAST.replace(ratio=1.0))
    assert copies and "rollback='inverse' keeps none" in copies[0]


def test_max_model_size_per_rank() -> None:
    # FSDP2 with weight-flow: the device keeps the root and two block units, each host 1/dp
    # of the fp32 state, of the bf16 copy and of FSDP2's bf16 block shards, so more ranks
    # raise the host-bound limit: 18 B/param alone, (18 + 2) / 4 = 5 B/param at dp=4
    one, four = plan.max_model_size(GH200, dp=1), plan.max_model_size(GH200, dp=4)
    assert 2.5 * one < four < 18 / 5 * one * 1.05
    pcie = plan.profiles.get("h100-pcie")
    assert plan.max_model_size(pcie, dp=8, ranks_per_host=8) <= plan.max_model_size(pcie, dp=8)
    layers = round((four / 12 / 128**2) ** (1 / 3))  # ~12 h^2 L params, h = 128 L
    fits = [plan.fit_problems(plan.gpt_by_layers(n, seq=1024, micro_batch=1, dp=4), GH200,
                              "superoffload") == [] for n in range(layers - 3, layers + 4)]
    assert True in fits and False in fits


def test_profiles_cite_their_collective_figures() -> None:
    for name in plan.profiles.names():
        prof = plan.profiles.get(name)
        assert prof.collective_gbps > 0 and prof.collective_latency_s >= 0
        assert "collective_gbps" in dict(prof.sources), name
        assert prof.is_estimate("collective_gbps")  # none of them is in FACTS.md
    with pytest.raises(ValueError, match="collective_gbps"):
        GH200.replace(collective_gbps=0.0)


def test_tune_with_ranks() -> None:
    cfg, why, pred = plan.tune(plan.ModelShape(**SMALL, dp=4), GH200)
    assert pred.shape.dp == 4 and pred.fits and pred.collective_s > 0
    assert cfg.weights == "stationary"


SHAPE = ["--profile", "gh200", "--layers", "8", "--hidden", "2048", "--heads", "16",
         "--seq", "2048", "--micro-batch", "1"]


def test_cli_dp(capsys) -> None:
    assert main(["simulate", *SHAPE, "--system", "superoffload", "--dp", "4", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["dp"] == 4 and res["collective_s"] > 0
    assert main(["simulate", *SHAPE, "--system", "superoffload", "--dp", "4",
                 "--collective-gbps", "450", "--json"]) == 0
    (fast,) = json.loads(capsys.readouterr().out)["results"]
    assert fast["collective_s"] < res["collective_s"]
    assert main(["simulate", *SHAPE, "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 2 ranks" in out and "per rank" in out
    assert main(["tune", *SHAPE, "--dp", "2", "--ranks-per-host", "2"]) == 0
    assert "data parallel: 2 ranks, 2 per host" in capsys.readouterr().out
    assert main(["simulate", *SHAPE, "--dp", "2", "--ranks-per-host", "4"]) == 2
    assert "ranks_per_host=4 exceeds dp=2" in capsys.readouterr().err
