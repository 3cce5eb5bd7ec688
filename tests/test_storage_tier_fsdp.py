"""The storage tier under FSDP2 (``FsdpOffloadEngine``, 2 gloo processes on the CPU): each
rank keeps its shards' state in its own file, trains bit for bit as the in-memory engine, and
its DCP checkpoint holds the tier's state, resumable on another world size (1 process).

One 2-process launch runs both trainings and the checkpoint scenario (tests/_fsdp_dp_worker.py
scenarios ``train`` and ``ckpt``); one 1-process launch resumes the 2-rank checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks
from _engine_ref import max_diff

WORKER = Path(__file__).with_name("_fsdp_dp_worker.py")
STEPS = 3


def _ranks(scenario: str, world: int, out: Path, args: dict) -> None:
    for r in run_ranks(scenario, world, out, timeout_s=600, args=args, worker=WORKER):
        assert r.returncode == 0, (
            f"rank {r.rank} of {scenario}: exit {r.returncode}\n{r.log[-4000:]}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("tier_fsdp")
    folder = str(out / "tier")
    clip = {"max_grad_norm": 0.5, "rollback": "snapshot"}
    tier = {"storage_path": folder, "storage_buffer_count": 2}
    runs = {"ram": clip, "tier": {**clip, **tier},
            "budget": {**clip, **tier, "host_memory_budget_bytes": 50_000}}
    ckpt_run = {**clip, **tier, "two_groups": True}
    _ranks("several", 2, out, {"do": [["train", {"steps": STEPS, "runs": runs}],
                                      ["ckpt", {"run": ckpt_run, "name": "ckpt"}]]})
    _ranks("resume", 1, out, {"run": ckpt_run, "ckpt": str(out / "ckpt"), "steps": 2})
    return {"out": out, "folder": Path(folder),
            "train": torch.load(out / "train_2.pt", weights_only=True),
            "ckpt": torch.load(out / "ckpt.pt", weights_only=True),
            "resume": torch.load(out / "resume_1.pt", weights_only=True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tier", "budget"])
def test_fsdp2_ranks_train_on_their_tier_files_bit_for_bit(launched: dict, name: str) -> None:
    got, ram = launched["train"][name], launched["train"]["ram"]
    assert max_diff(ram["weights"], got["weights"]) == 0.0
    assert max_diff(got["params"], got["weights"]) == 0.0  # the shards hold the masters
    assert got["stats"]["rollbacks"] == got["stats"]["replays"] > 0  # clipping undone by versions
    assert not any(launched["folder"].glob("superoffload-state-*"))  # every rank closed its file


@pytest.mark.slow
def test_a_dcp_checkpoint_holds_the_tier_and_resumes_on_another_world_size(
        launched: dict) -> None:
    res = launched["ckpt"]
    assert max_diff(res["w_save"], res["w_loaded"]) == 0.0  # the load restored the tier's state
    assert max_diff(res["w_a"], res["w_b"]) == 0.0  # and resumed bit-identically
    one = launched["resume"]  # the 2-rank checkpoint on 1 process
    assert max_diff(res["w_save"], one["loaded"]) == 0.0
