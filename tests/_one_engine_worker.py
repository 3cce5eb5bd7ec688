"""One rank of the one-engine tests at world size 2 (run by tests/test_one_engine_dp.py).

    python tests/_one_engine_worker.py SCENARIO OUT_DIR ARGS_JSON

Scenarios:
  schedule  build FsdpOffloadEngine for each config in args["configs"] and write the
            schedule it runs (effective ratio, bucket table, threads) per config, rank 0 only
  sparse    a layer only rank 0's loss uses and one no rank uses: train 3 steps, write the
            full masters and the model's full parameters (rank 0)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from _tiny_models import make_model

from superoffload.config import OffloadConfig
from superoffload.distributed import init_distributed, shutdown
from superoffload.distributed.fsdp import FsdpOffloadEngine

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


class Sparse(torch.nn.Module):
    """``rare`` is used only when asked (rank 0), ``idle`` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(8, 8)
        self.rare = torch.nn.Linear(8, 8)
        self.idle = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.idle.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = self.used(x)
        if use_rare:
            h = h + self.rare(x)
        return h.square().mean()


def sparse_data(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


def scenario_schedule(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    rows = {}
    for name, fields in args["configs"].items():
        model = make_model(0)
        with FsdpOffloadEngine(model, HYPER, OffloadConfig(**fields)) as engine:
            s = engine.schedule
            rows[name] = {"ratio": s.ratio, "table": [list(map(_plain, r))
                                                      for r in s.bucket_table()],
                          "threads": s.threads, "host_numel": s.host_numel,
                          "dp": s.dp, "weights": s.weights}
    if rank == 0:
        (out / "schedule.json").write_text(json.dumps(rows))


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def scenario_sparse(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    model = Sparse()
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=args["ratio"], cpu_threads=1,
                        telemetry=False, speculation="on")
    with FsdpOffloadEngine(model, HYPER, cfg) as engine:
        for x in sparse_data(3):
            half = x[rank * 2:(rank + 1) * 2]
            engine.backward(model(half, use_rare=rank == 0))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
        rollbacks = engine.stats.rollbacks
        engine.synchronize()  # every publish landed in the model's shards
        params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"masters": masters, "rollbacks": rollbacks, "params": params},
                   out / "sparse.pt")


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=float(args.get("timeout_s", 60)))
    {"schedule": scenario_schedule, "sparse": scenario_sparse}[scenario](
        out, info.rank, info.world_size, args)
    shutdown()



if __name__ == "__main__":
    main()
