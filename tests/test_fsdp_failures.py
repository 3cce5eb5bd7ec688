"""FSDP2 data parallel (2 gloo ranks on the CPU, tests/_fsdp_kill_worker.py): a killed rank
is named in the survivor's error, and every rank's buffers come back from a checkpoint.

* Rank 1 SIGKILLed before its forward, inside its backward, or inside the engine's step:
  rank 0's next collective (FSDP2's all-gather or reduce-scatter, the engine's validation
  all-reduce) fails at once. The error named the dead rank only for the backward: the dead
  process closes its connections before the kernel marks it as exited, so the survivor
  looked too early (process_group.py, ``PEER_EXIT_WAIT_S``). Now it says "rank(s) [1] on this
  host have exited" in all three, within seconds.
* BatchNorm's running statistics differ per rank (FSDP2 leaves buffers alone). After a DCP
  save and load, rank 0 came back with rank 1's running variance (DCP writes one copy of a
  tensor that is not sharded, from a rank of its choosing). Now each rank gets its own back
  exactly, and the checkpoint's one copy (`consolidate`, a load on another world size) is
  rank 0's (distributed/fsdp/checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks

WORKER = Path(__file__).with_name("_fsdp_kill_worker.py")


@pytest.mark.parametrize("at,slowly", [("forward", True), ("backward", True), ("step", True),
                                       ("step", False)])
def test_a_killed_rank_is_named_in_the_survivors_error(tmp_path: Path, at: str,
                                                      slowly: bool) -> None:
    """`slowly`: the dying rank's connections close half a second before it exits, so the
    survivor's collective always fails first (what a plain SIGKILL did in 2 of 3 places)."""
    results = run_ranks("killed", 2, tmp_path, timeout_s=120, wait_for=(0,), worker=WORKER,
                        args={"at": at, "slowly": slowly, "timeout_s": 60})
    assert results[0].returncode == 0, results[0].log[-4000:]
    record = json.loads((tmp_path / "killed_rank0.json").read_text())
    assert record["type"] == "DistributedError", record
    assert "rank 0 of 2: collective " in record["error"]
    assert "rank(s) [1] on this host have exited" in record["error"], record["error"]
    assert record["seconds"] < 30  # at once: the collective timeout is 60 s


def test_each_rank_gets_its_own_buffers_back_and_the_checkpoint_holds_rank_0s(
        tmp_path: Path) -> None:
    from superoffload.distributed.fsdp import consolidate

    results = run_ranks("buffers", 2, tmp_path, timeout_s=180, worker=WORKER)
    assert all(r.returncode == 0 for r in results), [r.log[-3000:] for r in results]
    ranks = [torch.load(tmp_path / f"buffers_rank{r}.pt") for r in range(2)]
    differ = (ranks[0]["saved"]["norm.running_var"] - ranks[1]["saved"]["norm.running_var"])
    assert float(differ.abs().max()) > 0.1  # each rank's statistics are its own
    for rank, got in enumerate(ranks):
        for key, saved in got["saved"].items():
            assert torch.equal(saved, got["loaded"][key]), (rank, key)
    rest = consolidate(str(tmp_path / "ckpt")).model_rest
    for key, saved in ranks[0]["saved"].items():
        assert torch.equal(rest[key], saved), key
