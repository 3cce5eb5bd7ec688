"""One rank of the sharded-checkpoint integrity tests (tests/test_zero_checkpoint_integrity.py,
run through tests/_dist_support.run_ranks).

    python tests/_zero_ckpt_worker.py two_saves OUT_DIR ARGS_JSON

Trains tests/_tiny_models.TinyGPT with ZeroOffloadEngine (tests/_zero_worker.py's settings:
speculation, clipping, a GPU tail) and saves a sharded checkpoint twice into two folders:
``OUT_DIR/a`` after 2 steps and ``OUT_DIR/b`` after 4, so a test can mix the files of two
saves of one run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from _zero_worker import build, global_data, train

from superoffload.distributed import init_distributed, shutdown

RUN = {"max_grad_norm": 0.5}


def scenario_two_saves(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(4)
    model, engine = build(RUN)
    train(model, engine, data, 0, 2, rank, world)
    engine.save_checkpoint(str(out / "a"), extra={"iteration": 2})
    train(model, engine, data, 2, 2, rank, world)
    engine.save_checkpoint(str(out / "b"), extra={"iteration": 4})
    engine.close()


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=60.0)
    {"two_saves": scenario_two_saves}[scenario](out, info.rank, info.world_size, args)
    shutdown()


if __name__ == "__main__":
    main()
