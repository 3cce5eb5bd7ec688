"""torch.distributed plumbing: torchrun environment, dp x sp groups, and failing ranks.

Multi-process tests run 2 gloo ranks on free ports with bounded waits; every process they
start is killed at the end (tests/_dist_support.py). Bounds are hang guards, not speed
targets: a dead or stalled rank must turn into a DistributedError on the survivor well within
30 s (the stalled case uses a 3 s collective timeout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_support import alive, run_ranks, run_torchrun

from superoffload.distributed import (
    DistributedError,
    dist_info,
    init_distributed,
    plan_parallel_layout,
    shutdown,
)

HANG_GUARD_S = 30.0


def test_layout_is_pure_and_consecutive_sp() -> None:
    layout = plan_parallel_layout(8, dp=2, sp=4)
    assert layout.sp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert layout.coords(6) == (1, 2)
    assert layout.sp_group_of(6) == (4, 5, 6, 7) and layout.dp_group_of(6) == (2, 6)
    # every rank in exactly one group of each kind
    for groups in (layout.sp_groups, layout.dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert plan_parallel_layout(6, sp=3).dp == 2
    assert plan_parallel_layout(1).sp_groups == ((0,),)


@pytest.mark.parametrize(("world", "dp", "sp", "match"), [
    (4, 3, 2, r"--dp 3 x --sp 2 = 6 does not match the world size 4"),
    (6, None, 4, r"--sp 4 does not divide the world size 6"),
    (4, None, 0, r"sp=0 is invalid"),
    (0, None, 1, r"world_size=0 is invalid"),
])
def test_layout_errors_name_the_numbers(world: int, dp: int | None, sp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_parallel_layout(world, dp=dp, sp=sp)


def test_layout_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, 4\)"):
        plan_parallel_layout(4, sp=2).coords(4)


def test_incomplete_torchrun_env_is_an_error() -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        init_distributed(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        init_distributed(timeout_s=0, env={})
    # a timeout that rounds to 0 in a timedelta was a raw C++ error
    for bad in (1e-9, 0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"invalid: use a finite number of seconds >= 1"):
            init_distributed(timeout_s=bad, env={})
    with pytest.raises(ValueError, match="backend='mpi' is not supported"):
        init_distributed(backend="mpi", env={})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match='backend="nccl" needs CUDA'):
            init_distributed(backend="nccl", env={})
    assert not dist.is_initialized()


def test_without_torchrun_is_a_single_rank() -> None:
    try:
        info = init_distributed(env={}, timeout_s=10)
        assert (info.rank, info.world_size, info.dp, info.sp) == (0, 1, 1, 1)
        assert dist_info() == info and dist.get_world_size() == 1
        assert init_distributed(env={}) == info  # idempotent
        with pytest.raises(ValueError, match="call shutdown\\(\\) before re-initialising"):
            init_distributed(env={}, sp=2)
    finally:
        shutdown()
    assert not dist.is_initialized()


def test_torchrun_launch_dp2(tmp_path: Path) -> None:
    code, log = run_torchrun("launch", 2, tmp_path, timeout_s=90, args={"sp": 1})
    assert code == 0, log[-3000:]
    records = [json.loads((tmp_path / f"launch_rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        info = rec["info"]
        assert (info["rank"], info["world_size"], info["local_rank"]) == (r, 2, r)
        assert (info["backend"], info["device"], info["dp"], info["sp"]) == ("gloo", "cpu", 2, 1)
        assert (info["dp_rank"], info["sp_rank"]) == (r, 0)
        assert rec["sum"] == 3.0  # all_reduce of rank+1 over 2 ranks
        assert rec["dp_group"] == [0, 1] and rec["sp_group"] == [r]
    _assert_no_orphans(tmp_path)


def _assert_no_orphans(out: Path) -> None:
    for pid_file in out.glob("pid_rank*.txt"):
        pid = int(pid_file.read_text())
        assert not alive(pid), f"worker pid {pid} outlived its test"


def test_dead_rank_fails_the_survivor_fast(tmp_path: Path) -> None:
    results = run_ranks("dies", 2, tmp_path, timeout_s=HANG_GUARD_S, args={"timeout_s": 20})
    assert results[1].returncode == 7, results[1].log[-2000:]
    assert results[0].returncode == 0, f"survivor hung or crashed:\n{results[0].log[-3000:]}"
    record = json.loads((tmp_path / "dies_rank0.json").read_text())
    assert record["type"] == DistributedError.__name__
    assert ("rank 0 of 2: collective all_reduce (mean_over_group) over ranks [0, 1] failed: "
            "rank(s) [1] on this host have exited") in record["error"]
    _assert_no_orphans(tmp_path)


def test_stalled_rank_times_out(tmp_path: Path) -> None:
    results = run_ranks("stalls", 2, tmp_path, timeout_s=HANG_GUARD_S, args={"timeout_s": 3},
                        wait_for=(0,))
    assert results[0].returncode == 0, f"survivor hung or crashed:\n{results[0].log[-3000:]}"
    assert results[1].returncode is None  # the staller was still alive: only the timeout fired
    record = json.loads((tmp_path / "stalls_rank0.json").read_text())
    assert record["type"] == DistributedError.__name__
    assert "a peer rank died, or stalled past 3 s" in record["error"]  # rank 1 is alive
    assert record["seconds"] >= 2.5  # it was the 3 s timeout, not a closed connection
    _assert_no_orphans(tmp_path)
