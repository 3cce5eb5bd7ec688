"""Two "nodes" on this machine: `torchrun --nnodes 2`, one process each (docs/distributed.md,
"Several hosts"), trained through `python -m superoffload train`, against the same job
launched on one node (`torchrun --standalone --nproc-per-node 2`).

Each node is its own torchrun agent, as on two hosts: the ranks meet through the rendezvous,
not through one launcher, and each sees LOCAL_WORLD_SIZE=1. Both ways a multi-node job is
started are covered (docs/distributed.md, "Several hosts"):
  * dp = 2 with the c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`;
    torchrun gives the node ranks in rendezvous order and ignores --node-rank there);
  * dp 1 x sp 2 (Ulysses across the nodes) with the static rendezvous
    (`--node-rank 0/1 --master-addr 127.0.0.1 --master-port PORT`), what `srun` recipes use.
The result must equal the single-node run bit for bit: the same global ranks get the same
data and the gloo sums of two ranks are the same in either order. ~60 s on 2 cores (four
2-process jobs of 3 steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _dist_support import alive, free_port

from superoffload.distributed.fsdp import consolidate

pytestmark = pytest.mark.slow

TRAIN = ["-m", "superoffload", "train", "--model", "tiny", "--steps", "3", "--batch", "4",
         "--seq", "32", "--eval-batches", "1", "--json", "--quiet", "--no-report",
         "--save-checkpoint"]
TIMEOUT_S = 180


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK"):
        env.pop(name, None)
    return env


def _kill_leftovers(text: str) -> list[int]:
    """SIGKILL live processes whose command line holds `text` (the run's --out); their pids.
    torchrun starts its workers in their own sessions: killing the agent's group is not
    enough."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(cmdline.parent.name)
            if pid != os.getpid() and text in cmdline.read_bytes().decode(errors="replace") \
                    and alive(pid):
                found.append(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    return found


def _launch(agents: list[list[str]], out: Path,
            layout: list[str]) -> list[tuple[int | None, str, str]]:
    """Start one torchrun agent per argument list, each training `layout` into `out`; wait
    for all, bounded. Returns (exit code, stdout, stderr) per agent."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *a, *TRAIN,
                               *layout, "--out", str(out)], env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True) for a in agents]
    results = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stdout, stderr = "", "timed out"
            results.append((p.poll(), stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    assert _kill_leftovers(str(out)) == []  # no worker outlives its job
    return results


def _single_node(out: Path, layout: list[str]) -> dict:
    (code, stdout, stderr), = _launch([["--standalone", "--nnodes", "1", "--nproc-per-node",
                                        "2"]], out, layout)
    assert code == 0, (stdout + stderr)[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _two_nodes(out: Path, rendezvous: str, layout: list[str]) -> dict:
    port = free_port()
    if rendezvous == "c10d":
        common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"so-{port}"]
        agents = [common, common]
    else:
        agents = [["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                   "--master-addr", "127.0.0.1", "--master-port", str(port)] for r in (0, 1)]
    results = _launch(agents, out, layout)
    for code, stdout, stderr in results:
        assert code == 0, (stdout + stderr)[-4000:]
    # rank 0 speaks for the job: exactly one node printed the result
    printed = [json.loads(s.strip().splitlines()[-1]) for _, s, _ in results if s.strip()]
    assert len(printed) == 1, [s for _, s, _ in results]
    return printed[0]


def _assert_same(a: Path, b: Path) -> None:
    """The two jobs' final sharded checkpoints hold the same numbers, bit for bit."""
    ca, cb = consolidate(str(a / "checkpoint")), consolidate(str(b / "checkpoint"))
    assert ca.manifest["world_size"] == cb.manifest["world_size"] == 2
    assert ca.manifest["iteration"] == cb.manifest["iteration"] == 3
    assert ca.states.keys() == cb.states.keys()
    for name, st in ca.states.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(st, key), getattr(cb.states[name], key)), (name, key)
    assert ca.extra["progress"] == cb.extra["progress"]


@pytest.mark.parametrize(("rendezvous", "layout"), [("c10d", ["--dp", "2"]),
                                                    ("static", ["--dp", "1", "--sp", "2"])])
def test_two_nodes_train_like_one(tmp_path: Path, rendezvous: str, layout: list[str]) -> None:
    one = _single_node(tmp_path / "one", layout)
    two = _two_nodes(tmp_path / "two", rendezvous, layout)
    want = {"dp": int(layout[1]), "sp": int(layout[3]) if len(layout) > 2 else 1}
    assert (two["dp"], two["sp"]) == (one["dp"], one["sp"]) == (want["dp"], want["sp"])
    for key in ("first_loss", "final_loss", "val_loss", "sample", "engine_stats", "tokens"):
        assert two[key] == one[key], key
    assert two["final_loss"] < two["first_loss"]
    _assert_same(tmp_path / "one", tmp_path / "two")


def test_rank_clocks_align_by_perf_counter_on_a_host_and_by_wall_clock_across() -> None:
    """The report's timeline puts every rank on rank 0's clock (train_dist.gather_rank_spans):
    perf_counter origins compare only on one host, so other hosts are placed by wall clock."""
    from superoffload.commands.train_dist import RankClock, clock_offsets

    lead = RankClock("node-a", origin_perf_s=100.0, origin_wall_s=1_700_000_000.0)
    same_host = RankClock("node-a", origin_perf_s=100.25, origin_wall_s=1_700_000_000.3)
    other_host = RankClock("node-b", origin_perf_s=9_000.0, origin_wall_s=1_700_000_000.5)
    assert clock_offsets([lead, same_host, other_host], lead) == pytest.approx([0.0, 0.25, 0.5])
