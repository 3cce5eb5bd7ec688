"""One engine at world size 2: the engine over FSDP2 runs the rule book's schedule
and steps a parameter iff some rank produced a gradient for it (as DDP + AdamW would: FSDP2
reduces zeros for a parameter a rank did not use; the engine carries which ones some rank
used in its validation reduce)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks
from _one_engine_worker import HYPER, Sparse, sparse_data
from _tiny_models import make_model

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.plan.schedule import ENGINE, ScheduleFacts, resolve_schedule
from superoffload.plan.techniques import Techniques, resolve
from superoffload.runtime.engine_state import EngineState
from superoffload.threads import usable_cores

WORKER = Path(__file__).with_name("_one_engine_worker.py")
BASE = {"device": "cpu", "bucket_bytes": 4096, "ratio": 0.5, "telemetry": False}


def _ok(results: list) -> None:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"


def test_fsdp_runs_the_rule_books_schedule_at_dp2(tmp_path: Path) -> None:
    configs = {"stationary": BASE, "flow": {**BASE, "weights": "flow"}}
    _ok(run_ranks("schedule", 2, tmp_path, timeout_s=120, args={"configs": configs},
                  worker=WORKER))
    got = json.loads((tmp_path / "schedule.json").read_text())
    model = make_model(0)
    specs = EngineState.from_model(model, [{"params": list(model.parameters())}]).param_specs()
    for name, fields in configs.items():
        facts = ScheduleFacts(params=specs, model_dtype="float32", device_type="cpu", dp=2,
                              usable_cores=usable_cores(), local_ranks=2, engine=ENGINE)
        want = resolve_schedule(OffloadConfig(**fields), facts)
        row = got[name]
        assert row["dp"] == 2 and row["weights"] == want.weights
        # and what the simulator runs for the same model at dp=2 (plan.techniques.resolve)
        shape = plan.ModelShape.from_module(model, seq=12, micro_batch=2).replace(dp=2)
        sim = resolve(shape, plan.profiles.get("cpu-laptop"), "superoffload",
                      OffloadConfig(**fields), Techniques(engine=ENGINE))
        assert sim.ratio == row["ratio"] and sim.host_numel == row["host_numel"]
        assert [[b.id, list(b.param_indices), b.numel, b.on_device]
                for b in sim.bucket_plan.buckets] == row["table"]
        assert row["ratio"] == want.ratio == (1.0 if name == "flow" else 0.5)
        assert row["table"] == [[b, list(p), n, d] for b, p, n, d in want.bucket_table()]
        assert row["threads"] == want.threads and row["host_numel"] == want.host_numel


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_parameter_steps_iff_some_rank_has_its_gradient(tmp_path: Path, ratio: float) -> None:
    _ok(run_ranks("sparse", 2, tmp_path, timeout_s=120, args={"ratio": ratio}, worker=WORKER))
    got = torch.load(tmp_path / "sparse.pt", weights_only=True)
    # reference: AdamW on the global-batch mean gradient; rank 1 contributes nothing to rare
    ref = Sparse()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for x in sparse_data(3):
        loss = (ref(x[:2], use_rare=True) + ref(x[2:], use_rare=False)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    masters = got["masters"]
    assert torch.equal(masters["idle.weight"], torch.ones(8, 8))  # nobody: untouched
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=0, atol=2e-6, msg=name)
    # and the weights the model computes with: FSDP2 reduced zeros for idle, so it was
    # stepped speculatively (weight decay alone moves it by lr * wd) and rolled back; the
    # restored value must reach its shards too, not only the master
    assert got["rollbacks"] > 0 or ratio == 0.0
    assert torch.equal(got["params"]["idle.weight"], torch.ones(8, 8))
    assert all(torch.equal(got["params"][n], masters[n]) for n in masters)
