"""One rank of the Trainer-under-torchrun test (tests/test_fsdp_trainer.py, via _dist_support).

    python tests/_fsdp_trainer_worker.py trainer OUT_DIR ARGS_JSON

``SuperOffloadTrainer`` on a tiny Llama with gloo: Trainer (Accelerate) starts the process
group from torchrun's variables, the trainer's ``so.initialize`` builds the engine over FSDP2
(the model's parameters become DTensor shards) and Trainer does not wrap the model in DDP.
Each rank writes the engine's class, the world size the engine sees, the losses Trainer
logged and the full fp32 masters (rank 0: ``trainer.pt``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from test_integrations_hf import ENGINE, Tokens, arguments, make_model

from superoffload.integrations.hf import SuperOffloadTrainer


def main() -> None:
    out, args = Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    model = make_model()
    trainer = SuperOffloadTrainer(
        model=model, args=arguments(out / "trainer", max_steps=args["steps"], logging_steps=1,
                                    eval_strategy="no", ddp_backend="gloo", use_cpu=True),
        train_dataset=Tokens(64, seed=1), offload_config=ENGINE)
    trainer.train()
    engine = trainer.engine
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    record: dict[str, Any] = {"engine": type(engine).__name__,
                              "world": getattr(engine, "world_size", 1), "losses": losses,
                              "iterations": engine.stats.iterations,
                              "sharded": all(hasattr(p, "device_mesh") for p in model.parameters())}
    masters = engine.master_weights()
    (out / f"trainer_rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(masters, out / "trainer.pt")
    trainer.close()


if __name__ == "__main__":
    main()
