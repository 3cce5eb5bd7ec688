"""``SuperOffloadTrainer`` under torchrun runs on the FSDP2 engine (2 gloo processes).

Trainer (Accelerate) starts the process group from torchrun's variables; the trainer's
``so.initialize`` then builds ``FsdpOffloadEngine`` (the model's parameters become DTensor
shards), and Trainer takes the path it has for a model that owns its placement and gradient
reduction (no DDP wrap). Accelerate gives rank r every other batch of one sampler, so 2 ranks x
2 accumulation steps see the same samples per optimizer step as one process accumulating 4:
the reference is single-process ``SuperOffloadTrainer`` with ``gradient_accumulation_steps=4``
(tests/test_integrations_hf.py's tiny Llama, fp32). Tolerance 1e-5 as that file's fp32 case
(the order of the gradient sums differs); the two ranks log the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist_support import run_ranks
from _engine_ref import max_diff

pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the 'hf' extra)")

WORKER = Path(__file__).with_name("_fsdp_trainer_worker.py")
STEPS = 6


def test_trainer_under_torchrun_runs_the_fsdp_engine(tmp_path: Path) -> None:
    from test_integrations_hf import ENGINE, Tokens, arguments, make_model

    from superoffload.integrations.hf import SuperOffloadTrainer

    results = run_ranks("trainer", 2, tmp_path, timeout_s=600, args={"steps": STEPS},
                        worker=WORKER)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"
    ranks = [json.loads((tmp_path / f"trainer_rank{r}.json").read_text()) for r in range(2)]
    for rec in ranks:
        assert rec["engine"] == "FsdpOffloadEngine" and rec["world"] == 2 and rec["sharded"]
        assert rec["iterations"] == STEPS
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == STEPS
    got = torch.load(tmp_path / "trainer.pt", weights_only=True)
    model = make_model()
    trainer = SuperOffloadTrainer(
        model=model, args=arguments(tmp_path / "ref", max_steps=STEPS, logging_steps=1,
                                    eval_strategy="no", gradient_accumulation_steps=4),
        train_dataset=Tokens(64, seed=1), offload_config=ENGINE)
    trainer.train()
    want = trainer.engine.master_weights()
    trainer.close()
    assert max_diff(want, got) < 1e-5
