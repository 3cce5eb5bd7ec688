"""ZeRO data parallel with sharded offloaded state (issue 7): 2 gloo processes on the CPU.

References are plain PyTorch on one process (tests/_engine_ref.py: torch.optim.AdamW,
clip_grad_norm_) over the *global* batch; each rank of the data-parallel run sees half of
every global batch (tests/_zero_worker.py). Tolerances:
  * fp32: 1e-6 absolute on the fp32 masters after 4 steps (measured 1.2e-7: the only
    difference is the order of the fp32 gradient sums, mean of halves vs mean of all);
  * bf16 / fp16: the ranks' gradients are rounded to 16 bits on half batches before they are
    summed, so single elements may take a different Adam step (|update| <= lr per step):
    max |diff| <= lr * steps, and the mean |diff| and the share of elements beyond 1e-4
    are checked tighter (measured 2.7e-5 and 2.4%).
Subprocess waits are bounded (tests/_dist_support.py); the five launches take ~45 s on an
idle 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks
from _engine_ref import HYPER, max_diff, train_reference
from _tiny_models import make_model
from _zero_worker import decay, global_data
from hypothesis import given, settings
from hypothesis import strategies as st

from superoffload.distributed.zero.budget import (
    HostBudget,
    HostMemoryError,
    available_host_bytes,
    check_host_budget,
    shard_host_bytes,
)
from superoffload.distributed.zero.checkpoint import consolidate
from superoffload.distributed.zero.layout import all_layouts, shard_layout
from superoffload.threads import optimizer_threads, usable_cores

WORKER = Path(__file__).with_name("_zero_worker.py")
STEPS = 4
RUNS = {
    # speculation on + clipping every step: speculative shard steps, rollback and replay
    "clip": {"max_grad_norm": 0.5},
    # the gloo fallback (all-reduce + own slice), snapshot rollback, two param groups
    "fallback": {"reduce_mode": "all_reduce", "rollback": "snapshot", "two_groups": True,
                 "max_grad_norm": 0.5},
    # gradient accumulation, every bucket offloaded (no GPU tail), no clipping
    "gas": {"grad_accum_steps": 2, "ratio": 1.0},
    "bf16": {"dtype": "bfloat16", "max_grad_norm": 0.5},
    # an overflow on rank 1 only in step 1: every rank rolls back and skips that step
    "skip": {"poison_step": 1, "rollback": "snapshot"},
    # no speculation: every shard is stepped after validation
    "nospec": {"speculation": "off", "max_grad_norm": 0.5},
    # weight-flow (zero_flow.py): the all-gather fills the blocks' host homes, each block
    # streams in per fetch; with clipping (rollback + replay + second gather), with
    # accumulation (same plan as "gas": must match it bit for bit), and in bf16
    "flow": {"weights": "flow", "max_grad_norm": 0.5},
    "flow_gas": {"weights": "flow", "grad_accum_steps": 2},
    "flow_bf16": {"weights": "flow", "dtype": "bfloat16", "max_grad_norm": 0.5},
}


def _ranks(scenario: str, world: int, out: Path, args: dict, **kw: object) -> list:
    results = run_ranks(scenario, world, out, timeout_s=120, args=args, worker=WORKER, **kw)
    for r in results:
        if kw.get("wait_for") is None:
            assert r.returncode == 0, f"rank {r.rank} of {scenario}: exit {r.returncode}\n{r.log[-4000:]}"
    return results


def _reference(run: dict, sched: object = None) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, run.get("dtype", "float32"))
    gas = run.get("grad_accum_steps", 1)
    data, steps = global_data(2 * STEPS), STEPS
    if "poison_step" in run:  # a skipped step consumes its batch and changes nothing
        del data[run["poison_step"]]
        steps -= 1
    return train_reference(make_model(0, dtype), data, steps=steps, gas=gas,
                           max_norm=run.get("max_grad_norm"),
                           two_groups=run.get("two_groups", False), sched=sched)


# ---------------------------------------------------------------- pure parts
@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=6), world=st.integers(1, 5))
def test_shards_tile_the_bucket_exactly(numels: list[int], world: int) -> None:
    covered = {}
    layouts = all_layouts(numels, world)
    for lay in layouts:
        assert lay.padded_numel % world == 0 and lay.padded_numel - lay.bucket_numel < world
        for s in lay.segments:
            assert s.shard_offset >= 0 and s.shard_offset + s.numel <= lay.shard_numel
            for k in range(s.numel):
                key = (s.pos, s.param_offset + k)
                assert key not in covered, "two ranks own one element"
                covered[key] = lay.shard_start + s.shard_offset + k
    expected = {(pos, k): layouts[0].param_offsets[pos] + k
                for pos, n in enumerate(numels) for k in range(n)}
    assert covered == expected  # every element once, at its flat-bucket position


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        shard_layout([3], rank=0, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        shard_layout([3], rank=2, world_size=2)
    with pytest.raises(ValueError, match="param_numels"):
        shard_layout([-1], rank=0, world_size=1)


def test_threads_split_the_cores_between_local_ranks() -> None:
    # the one thread rule (superoffload/threads.py), as the ZeRO engine applies it
    assert optimizer_threads(16, 1.0, local_ranks=1) == 16
    assert optimizer_threads(16, 0.9, local_ranks=4) == 3  # floor(4 cores x 0.9)
    assert optimizer_threads(2, 0.5, local_ranks=8) == 1  # never 0
    assert optimizer_threads(16, 0.9, local_ranks=1, reserved=2) == 14  # GPU host: 2 runtime
    assert optimizer_threads(16, 1.0, local_ranks=1, reserved=2) == 14  # threads keep cores
    assert optimizer_threads(16, 0.9, explicit=32) == 16  # capped at the share
    with pytest.raises(ValueError, match="local_ranks"):
        optimizer_threads(16, 0.9, local_ranks=0)


def test_host_budget_raises_before_allocating() -> None:
    per_rank = shard_host_bytes(1 << 20, grad_bytes=4, lp_bytes=2, snapshot=True)
    assert per_rank == (1 << 20) * (12 + 4 + 2 + 12)
    check_host_budget(HostBudget(per_rank, 2, available_bytes=10 * per_rank))
    with pytest.raises(HostMemoryError, match=r"2 rank\(s\) on this host.*--nproc-per-node"):
        check_host_budget(HostBudget(per_rank, 2, available_bytes=2 * per_rank))


def test_available_memory_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    with_psutil = available_host_bytes()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    from_meminfo = available_host_bytes()
    assert with_psutil > 0 and from_meminfo > 0
    assert abs(with_psutil - from_meminfo) < 0.25 * with_psutil  # the same quantity


# ---------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("zero_train")
    _ranks("train", 2, out, {"steps": STEPS, "runs": RUNS})
    return torch.load(out / "train.pt", weights_only=True)


@pytest.mark.parametrize("name", ["clip", "fallback", "gas", "skip", "nospec"])
def test_dp_matches_single_process_fp32(trained: dict, name: str) -> None:
    got = trained[name]
    assert max_diff(_reference(RUNS[name]), got["weights"]) < 1e-6
    # the parameters every rank computes with are the all-gathered masters
    assert max_diff(got["params"], got["weights"]) == 0.0
    assert got["stats"]["iterations"] == STEPS
    assert got["stats"]["skipped_steps"] == (1 if name == "skip" else 0)
    assert (got["stats"]["speculated_buckets"] == 0) == (name == "nospec")


def test_dp_exercises_speculation_rollback_and_the_fallback(trained: dict) -> None:
    clip = trained["clip"]["stats"]
    assert clip["clipped_steps"] == STEPS and clip["speculated_buckets"] > 0
    assert clip["rollbacks"] == clip["replays"] == clip["speculated_buckets"]
    assert trained["gas"]["stats"]["rollbacks"] == 0
    assert trained["fallback"]["mode"] == "all_reduce"
    assert trained["clip"]["mode"] == "reduce_scatter"  # gloo of torch >= 2.x has it
    assert trained["clip"]["local_world_size"] == 2
    assert trained["clip"]["threads"] == optimizer_threads(usable_cores(), 0.9, local_ranks=2)


def _share_beyond(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                  atol: float) -> float:
    """Share of the elements differing by more than ``atol``. bf16 DP budget: rounding the
    half-batch gradients to 16 bits flips single elements' Adam steps (up to lr each, hence
    max <= lr * steps); the rest agree to 1e-4. Measured 2.4% beyond 1e-4 (bound 10%); a
    reference without clipping is 54% off, one with a step fewer 95%: both pass the max."""
    beyond = sum(int(((ref[k] - got[k]).abs() > atol).sum()) for k in ref)
    return beyond / sum(v.numel() for v in ref.values())


def test_dp_bf16_within_rounding_of_single_process(trained: dict) -> None:
    ref, got = _reference(RUNS["bf16"]), trained["bf16"]["weights"]
    assert max_diff(ref, got) <= HYPER["lr"] * STEPS
    mean = sum(float((ref[k] - got[k]).abs().sum()) for k in ref) / sum(v.numel() for v in ref.values())
    assert mean < 2e-4
    assert _share_beyond(ref, got, 1e-4) < 0.1  # budget: see _share_beyond
    params = trained["bf16"]["params"]
    assert all(torch.equal(params[k], got[k].to(torch.bfloat16)) for k in got)


def test_dp_with_weight_flow_matches_single_process_and_stationary(trained: dict) -> None:
    flow = trained["flow"]
    assert max_diff(_reference(RUNS["flow"]), flow["weights"]) < 1e-6  # measured 1.2e-7
    # the same buckets (weight-flow plans ratio 1, as "gas" does) and the same kernel calls:
    # streaming changes where the weights live, not one bit of the numbers
    assert max_diff(trained["gas"]["weights"], trained["flow_gas"]["weights"]) == 0.0
    # close() made every block resident again, holding the all-gathered masters
    assert max_diff(flow["params"], flow["weights"]) == 0.0
    assert flow["stats"]["clipped_steps"] == STEPS and flow["stats"]["replays"] > 0
    for name in ("flow", "flow_gas", "flow_bf16"):
        got = trained[name]
        # the blocks really streamed: released between iterations, fetched every forward
        assert got["n_blocks"] == 3 and got["fetches"] >= STEPS * got["n_blocks"]
        assert got["released"] and not any(got["released"])
    bf16 = trained["flow_bf16"]
    ref = _reference(RUNS["bf16"])
    assert max_diff(ref, bf16["weights"]) <= HYPER["lr"] * STEPS
    assert _share_beyond(ref, bf16["weights"], 1e-4) < 0.1  # budget: see _share_beyond
    # identical to the stationary bf16 run up to the plan (ratio 1 vs 0.8): on the CPU both
    # step with the same kernel on the same reduced gradients, so only fp32 last bits differ
    # (measured 3.0e-8; was <= lr * steps = 0.012, which untrained weights miss by only 8%)
    assert max_diff(trained["bf16"]["weights"], bf16["weights"]) < 1e-6
    assert all(torch.equal(bf16["params"][k], bf16["weights"][k].to(torch.bfloat16))
               for k in bf16["weights"])


def test_host_budget_error_on_every_rank(trained: dict) -> None:
    msg = trained["budget_error"]
    assert msg is not None and "host memory budget exceeded on this host" in msg
    assert "2 rank(s) on this host" in msg


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("zero_ckpt")
    _ranks("ckpt", 2, out, {"run": RUNS["fallback"]})
    return out, torch.load(out / "ckpt.pt", weights_only=True)


def test_sharded_checkpoint_files_and_same_world_resume(checkpointed: tuple[Path, dict]) -> None:
    out, res = checkpointed
    files = sorted(p.name for p in (out / "ckpt").iterdir())
    assert files == ["manifest.json", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    assert res["iteration_loaded"] == 2 and res["extra"] == {"note": "after 2 steps"}
    # resume on the same world size is bit-identical to training straight through
    assert max_diff(res["w_a"], res["w_b"]) == 0.0
    assert max_diff(_reference(RUNS["fallback"], decay), res["w_a"]) < 1e-6


def test_sharded_checkpoint_resume_under_weight_flow(tmp_path: Path) -> None:
    """Save with the blocks released, load into a fresh weight-flow engine: bit-identical."""
    _ranks("ckpt", 2, tmp_path, {"run": RUNS["flow"]})
    got = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert got["iteration_loaded"] == 2
    assert max_diff(got["w_a"], got["w_b"]) == 0.0
    assert max_diff(got["w_a"], got["w_save"]) > 0.0  # the last two steps changed something


def test_consolidation_rebuilds_full_fp32_state(checkpointed: tuple[Path, dict]) -> None:
    out, res = checkpointed
    cons = consolidate(str(out / "ckpt"))
    sd = cons.state_dict()
    assert all(sd[k].dtype == torch.float32 for k in res["w_save"])
    assert max_diff({k: sd[k] for k in res["w_save"]}, res["w_save"]) == 0.0
    assert {s.step for s in cons.states.values()} == {2}
    assert set(sd) >= set(make_model(0).state_dict())  # tied head.weight is in model_rest


def test_consolidation_names_a_missing_rank_file(checkpointed: tuple[Path, dict],
                                                 tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpointed[0] / "ckpt", broken)
    (broken / "rank00001-of-00002.pt").unlink()
    with pytest.raises(FileNotFoundError, match="rank00001-of-00002.pt"):
        consolidate(str(broken))


@pytest.fixture(scope="module")
def resumed_on_one(checkpointed: tuple[Path, dict]) -> tuple[Path, dict]:
    """The 2-rank checkpoint resumed on 1 rank for 2 steps, then saved by that 1 rank."""
    out = checkpointed[0] / "resume1"
    _ranks("resume", 1, out, {"run": RUNS["fallback"], "ckpt": str(checkpointed[0] / "ckpt"),
                              "steps": 2, "save_to": str(out / "ckpt1")})
    return out, torch.load(out / "resume_1.pt", weights_only=True)


def test_resume_on_fewer_ranks(checkpointed: tuple[Path, dict],
                               resumed_on_one: tuple[Path, dict]) -> None:
    # 2 -> 1 ranks: the same maths, the gradient sums in another order
    assert max_diff(resumed_on_one[1]["weights"], checkpointed[1]["w_a"]) < 1e-6


def test_resume_on_more_ranks(resumed_on_one: tuple[Path, dict]) -> None:
    # 1 -> 2 ranks: each rank cuts its new slice; no step in between, so bit-identical
    out, one = resumed_on_one
    _ranks("resume", 2, out / "two", {"run": RUNS["fallback"], "ckpt": str(out / "ckpt1"),
                                      "steps": 0})
    two = torch.load(out / "two" / "resume_2.pt", weights_only=True)["weights"]
    assert max_diff(two, one["weights"]) == 0.0


def test_a_dead_rank_stops_the_others(tmp_path: Path) -> None:
    results = _ranks("dies", 2, tmp_path, {"run": RUNS["clip"], "timeout_s": 30},
                     wait_for=(0,))
    assert results[0].returncode == 0, results[0].log[-4000:]
    record = json.loads((tmp_path / "dies_rank0.json").read_text())
    assert record["type"] == "DistributedError", record
    assert "rank(s) [1] on this host have exited" in record["error"]
    assert record["seconds"] < 30  # bounded: the dist timeout; gloo notices at once


def test_train_command_under_torchrun(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m superoffload train`: ZeRO data parallel on gloo."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", "-m", "superoffload", "train", "--steps", "3", "--model",
           "tiny", "--batch", "4", "--seq", "32", "--eval-batches", "1", "--json",
           "--quiet", "--save-checkpoint", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, log[-4000:]
    result = json.loads(log.strip().splitlines()[-1])
    assert result["dp"] == 2 and result["batch"] == 4 and result["batch_per_rank"] == 2
    assert result["engine_stats"]["iterations"] == 3
    assert result["final_loss"] < result["first_loss"]
    ckpt = consolidate(str(tmp_path / "run" / "checkpoint"))
    assert ckpt.manifest["world_size"] == 2 and ckpt.manifest["iteration"] == 3
    # the job's token rate is both ranks' (each trains on its own half of the batch)
    assert result["tokens_per_s"] == pytest.approx(2 * result["tokens_per_s_per_rank"])
    assert result["tokens"] == 3 * 4 * 32
    # rank 0's report draws both ranks' lanes, gathered over the process group
    html = Path(result["report"]).read_text()
    assert '"r0 D2H (grads out)"' in html and '"r1 D2H (grads out)"' in html
    assert '"r1 CPU optimizer"' in html


# ---------------------------------------------------------------- one rank, in this process
def test_one_rank_is_bit_identical_to_the_single_process_engine() -> None:
    """World size 1: the same buckets, kernel calls and verdicts as OffloadEngine, so the
    masters match bit for bit (inline lanes and threads alike), weight-flow included."""
    from _engine_ref import groups_for, train_engine

    from superoffload.config import OffloadConfig
    from superoffload.distributed import init_distributed, shutdown
    from superoffload.distributed.zero import ZeroOffloadEngine

    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.8, max_grad_norm=0.5,
                        telemetry=False)
    data = global_data(STEPS)
    want, _ = train_engine(make_model(0), data, cfg, steps=STEPS)
    flow_cfg = cfg.replace(weights="flow")
    want_flow, _ = train_engine(make_model(0), data, flow_cfg, steps=STEPS)
    model = make_model(0)
    with pytest.raises(RuntimeError, match="init_distributed"):
        ZeroOffloadEngine(model, None, cfg)
    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        for inline, config, ref in ((True, cfg, want), (False, cfg, want),
                                    (True, flow_cfg, want_flow), (False, flow_cfg, want_flow)):
            model = make_model(0)
            with ZeroOffloadEngine(model, groups_for(model, False, HYPER), config,
                                   inline=inline) as engine:
                for x, y in data:
                    engine.backward(model(x, y))
                    engine.step()
                    engine.zero_grad()
                got = engine.full_master_weights()
                assert engine.stats.rollbacks > 0  # clipping: the STV path ran
                assert (engine.weights.flow is not None) == (config.weights == "flow")
            assert max_diff(ref, got) == 0.0
    finally:
        shutdown()
