"""dp x sp: Ulysses sequence parallel with the FSDP2 engine, with weight-flow, and in `train`.
2 gloo processes on the CPU (dp=1, sp=2): FSDP2 shards over the mesh's flattened (dp_shard,
sp) dimensions, Ulysses' all-to-all runs on its sp dimension (distributed/mesh.py); a 4-rank
dp=2 x sp=2 layout uses the same code paths but is not run here (2 cores).

References are one process on the *full* sequences (tests/_dp_sp_worker.py builds the same GPT
and batches from the same seeds). fp32, 4 AdamW steps (lr 3e-3) with clipping every step.
Only the summation order differs (the gradient is the average of two half-sequence gradients
added in an all-reduce; attention runs per head chunk), but Adam divides by sqrt(v) ~ |g|, so
an element whose gradient is pure rounding noise moves by up to ~lr either way: the key bias
(a third of qkv.bias) has a gradient that is exactly 0 in exact arithmetic (softmax ignores a
constant added to every key), and a few elements of other tensors are nearly 0. Hence:
  * max |diff| < 5e-5 (lr / 60; a wrong reduction factor or a missing half of the sequence
    moves weights by ~lr), measured 1.1e-5 (FSDP2 stationary and weight-flow alike);
  * mean |diff| < 1e-7 over all elements, measured 6.5e-9 (both);
  * the two ranks' weights are compared bit for bit (replicated computation).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist_support import alive, run_ranks
from _dp_sp_worker import STEPS, dp_config, flow_config, global_data, make_gpt
from _engine_ref import max_diff, train_engine, train_reference

WORKER = Path(__file__).with_name("_dp_sp_worker.py")
MAX_TOL, MEAN_TOL = 5e-5, 1e-7


def _close(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """max and mean |diff| within the tolerances above (max_diff checks the keys too)."""
    assert max_diff(want, got) < MAX_TOL
    total = sum(float((want[k] - got[k]).abs().sum()) for k in want)
    assert total / sum(v.numel() for v in want.values()) < MEAN_TOL


def _run(scenario: str, out: Path, **args: object) -> list[dict]:
    results = run_ranks(scenario, 2, out, timeout_s=150, args={"sp": 2, **args}, worker=WORKER)
    for r in results:
        assert r.returncode == 0, (
            f"rank {r.rank} of {scenario}: exit {r.returncode}\n{r.log[-4000:]}")
    name = "fsdp_flow_sp" if args.get("flow") else scenario
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def fsdp_sp(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run("fsdp_sp", tmp_path_factory.mktemp("fsdp_sp"))


def test_fsdp_over_dp_shard_and_sp_matches_full_sequence_training(fsdp_sp: list[dict]) -> None:
    cfg = dp_config()
    ref = train_reference(make_gpt(0), global_data(STEPS), steps=STEPS,
                          max_norm=cfg.max_grad_norm)
    got = fsdp_sp[0]
    assert got["world"] == 2 and got["sp_mesh_dim"] == 2  # sharded over both sp ranks
    _close(ref, got["weights"])
    # what each rank computes with is the all-gathered shards: the masters, on both ranks
    assert max_diff(got["params"], got["weights"]) == 0.0
    assert max_diff(fsdp_sp[1]["params"], got["params"]) == 0.0
    stats = got["stats"]
    assert stats["iterations"] == STEPS and stats["clipped_steps"] == STEPS
    assert stats["rollbacks"] > 0  # speculation, rollback and replay ran on the shards


def test_fsdp_sp_losses_are_the_full_sequence_losses(fsdp_sp: list[dict]) -> None:
    """The mean of the two ranks' local losses is the loss of the full sequence: checked
    for the first step (same weights) against one process."""
    model = make_gpt(0)
    x, y = global_data(1)[0]
    with torch.no_grad():
        full = float(model(x, y))
    assert abs(fsdp_sp[0]["losses"][0] - full) < 2e-6  # measured 4.8e-7: 1 ulp at 5.6
    assert fsdp_sp[0]["losses"] == fsdp_sp[1]["losses"]


def test_ulysses_with_weight_flow_matches_stationary(tmp_path: Path) -> None:
    ranks = _run("flow_sp", tmp_path)
    stationary = flow_config().replace(weights="stationary")
    want, _ = train_engine(make_gpt(0), global_data(STEPS), stationary, steps=STEPS)
    _close(want, ranks[0]["weights"])
    assert max_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0  # replicas stay equal
    assert ranks[0]["fetches"] > 0  # the blocks really streamed
    ref = train_reference(make_gpt(0), global_data(STEPS), steps=STEPS,
                          max_norm=stationary.max_grad_norm)
    _close(ref, ranks[0]["weights"])


def test_fsdp_with_weight_flow_over_sp_matches(tmp_path: Path, fsdp_sp: list[dict]) -> None:
    """FsdpOffloadEngine + weight-flow + Ulysses: the block units' shards on the host,
    all-gathered per unit; the same numbers as weight-stationary and as one process on the
    full sequences."""
    ranks = _run("fsdp_sp", tmp_path, flow=True)
    cfg = flow_config()
    ref = train_reference(make_gpt(0), global_data(STEPS), steps=STEPS,
                          max_norm=cfg.max_grad_norm)
    got = ranks[0]
    _close(ref, got["weights"])
    _close(fsdp_sp[0]["weights"], got["weights"])
    assert max_diff(got["params"], got["weights"]) == 0.0
    assert max_diff(ranks[1]["params"], got["params"]) == 0.0
    # every forward materialized each block (FSDP2's all-gather), whose shards live on the host
    assert got["blocks"] == 2 and got["fetches"] >= STEPS * got["blocks"] and got["on_host"]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (the run's unique --out folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            pid = int(cmdline.parent.name)
            if text in cmdline.read_bytes().decode(errors="replace") and alive(pid):
                found.append(pid)
        except OSError:
            continue
    return found


def _torchrun_train(tmp_path: Path, *extra: str) -> tuple[int | None, str]:
    """`python -m torch.distributed.run --nproc-per-node 2 -m superoffload train ...` in its own
    session, killed as a group if it outlives the bounded wait. Returns (exit code, log)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", "-m", "superoffload", "train", "--model", "tiny",
           "--batch", "2", "--eval-batches", "1", "--no-report", "--json", "--quiet",
           "--out", str(tmp_path / "run"), *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode, log


def test_train_command_with_sequence_parallel(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m superoffload train --dp 1 --sp 2`: Ulysses + FSDP2."""
    code, log = _torchrun_train(tmp_path, "--dp", "1", "--sp", "2", "--steps", "3",
                                "--seq", "32", "--save-checkpoint")
    assert code == 0, log[-4000:]
    result = json.loads(log.strip().splitlines()[-1])
    assert (result["dp"], result["sp"], result["seq"], result["seq_per_rank"]) == (1, 2, 32, 16)
    assert result["engine_stats"]["iterations"] == 3
    assert all(torch.isfinite(torch.tensor([result["first_loss"], result["val_loss"]])))
    assert result["final_loss"] < result["first_loss"]
    from superoffload.distributed.fsdp import consolidate

    ckpt = consolidate(str(tmp_path / "run" / "checkpoint"))
    assert ckpt.manifest["world_size"] == 2  # the state is sharded over both sp ranks
    assert _processes_naming(str(tmp_path / "run")) == []  # no worker outlives the run


def test_train_command_with_sequence_parallel_and_weight_flow(tmp_path: Path) -> None:
    """`train --sp 2 --weights flow`: Ulysses + FSDP2 + weight-flow under torchrun."""
    code, log = _torchrun_train(tmp_path, "--dp", "1", "--sp", "2", "--steps", "3",
                                "--seq", "32", "--weights", "flow", "--save-checkpoint")
    assert code == 0, log[-4000:]
    result = json.loads(log.strip().splitlines()[-1])
    assert (result["sp"], result["weights"]) == (2, "flow")
    assert result["engine_stats"]["iterations"] == 3
    assert result["final_loss"] < result["first_loss"]
    from superoffload.distributed.fsdp import consolidate

    assert consolidate(str(tmp_path / "run" / "checkpoint")).manifest["world_size"] == 2
    assert _processes_naming(str(tmp_path / "run")) == []


def test_train_command_rejects_a_bad_sp(tmp_path: Path) -> None:
    """--sp that does not divide the sequence: every rank exits with a message, no hang."""
    code, log = _torchrun_train(tmp_path, "--sp", "2", "--steps", "1", "--seq", "31")
    assert code not in (0, None), log[-4000:]
    assert "--seq=31 is not divisible by --sp=2" in log
    assert _processes_naming(str(tmp_path / "run")) == []
