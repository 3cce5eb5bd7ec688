"""Data-parallel ranks keep the contract together (docs/distributed.md, "The torch
contract"), over FSDP2.

Two gloo processes (tests/_contract_worker.py). Ranks that disagree (different lr, model
width, ratio, bucket size, a parameter frozen on one rank, max_grad_norm) used to train apart
silently, die with SIGABRT inside gloo, or block until the collective timeout: every rank now
raises one ``RanksDisagree`` at construction naming the field and the ranks; a hyper-parameter
changed on one rank mid-run is caught by the hash the validation all-reduce carries. A
gradient edited on one rank raises ``GradientEdited`` on both (the iteration rolled back), and
weights written with ``model.load_state_dict`` on every rank are adopted shard by shard,
matching plain AdamW within 1e-5 (fp32; measured ~1e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks
from _engine_ref import HYPER, max_diff
from _fsdp_dp_worker import global_data
from _tiny_models import make_model

WORKER = Path(__file__).with_name("_contract_worker.py")
TIMEOUT_S = 120.0


def results(tmp_path: Path, scenario: str, args: dict | None = None) -> list[dict]:
    ranks = run_ranks(scenario, 2, tmp_path, timeout_s=TIMEOUT_S, args=args, worker=WORKER)
    for r in ranks:  # every rank ended by itself (no SIGABRT, no hang until the timeout)
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.log[-3000:]}"
    return [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("field,named", [
    ("lr", "param_groups"), ("weight_decay", "param_groups"), ("width", "parameter #0"),
    ("ratio", "config.ratio"), ("bucket_bytes", "config.bucket_bytes"), ("frozen", "parameter #2"),
    ("max_grad_norm", "config.max_grad_norm"),
])
def test_ranks_that_disagree_all_raise_naming_the_field(tmp_path, field, named):
    got = results(tmp_path, "mismatch", {"field": field})
    for r in got:
        assert r["type"] == "RanksDisagree", r
        assert named in r["error"] and "ranks [0]" in r["error"] and "ranks [1]" in r["error"]


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_hyper_parameter_changed_on_one_rank_mid_run(tmp_path, key):
    """weight_decay 0.1 on rank 0 and 0.2 on rank 1 (or a halved lr): caught by the hash the
    validation all-reduce carries, which covers every field of AdamHyper (runtime/contract.py;
    each field one by one: tests/test_rank_agreement.py)."""
    got = results(tmp_path, "midrun", {"key": key})
    for r in got:
        assert r["type"] == "RanksDisagree", r
        assert "param_groups" in r["error"] and key in r["error"]


def test_clip_grad_norm_returns_torchs_norm_of_the_global_gradient(tmp_path):
    """engine.clip_grad_norm_ on 2 ranks returns what torch.nn.utils.clip_grad_norm_ returns
    on the whole batch (not a rank's share, not off by sqrt(2)), and the run matches AdamW
    clipped by it (1e-5; 1 rank: tests/test_contract.py)."""
    got = results(tmp_path, "clipnorm")
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    norms = []
    for x, y in global_data(3):
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    for r in got:
        assert r["norms"] == pytest.approx(norms, rel=1e-5), (r["norms"], norms)
    ref = {n: p.detach() for n, p in model.named_parameters()}
    assert max_diff(ref, torch.load(tmp_path / "clipnorm.pt")) < 1e-5


def test_gradient_edited_on_one_rank_raises_on_both(tmp_path):
    got = results(tmp_path, "edit")
    for r in got:
        assert r["type"] == "GradientEdited", r
        assert r["rolled_back"] < 1e-6  # the inverse rollback: a few ulps of weights ~0.1
    assert "other rank" in got[0]["error"]  # rank 0 edited nothing itself


def test_weights_written_with_load_state_dict_are_adopted_per_shard(tmp_path):
    got = results(tmp_path, "write")
    assert all(r["type"] is None for r in got), got
    engine_w = torch.load(tmp_path / "write.pt")
    # reference: plain AdamW + clipping on the global batch, the same load between steps
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    data = global_data(6)

    def one(k: int) -> None:
        model(*data[k]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    one(0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    one(1)
    model.load_state_dict(saved)
    one(2)
    one(3)
    ref = {n: p.detach() for n, p in model.named_parameters()}
    assert max_diff(ref, engine_w) < 1e-5
