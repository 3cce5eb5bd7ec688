"""One rank of the FSDP2-transport prototype test (issue 21 §5; tests/test_fsdp_engine.py).

    python tests/_fsdp_engine_worker.py engine OUT_DIR ARGS_JSON

Trains superoffload's tiny GPT twice on this world size, from the same weights on the same
global batches (each rank its slice): once with ``ZeroOffloadEngine`` (our reduce-scatter /
all-gather transport) and once with ``OffloadEngine`` over ``FsdpTransport`` on a model
sharded by ``fully_shard`` (every block, then the root). Both with speculation, clipping
every step (so speculative steps are rolled back and replayed) and every bucket offloaded.
Rank 0 writes ``engine.json``: the mean loss over the ranks per step of each run, the max
|diff| of the gathered fp32 masters, the engines' counters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from superoffload.config import OffloadConfig
from superoffload.distributed import init_distributed, shutdown
from superoffload.distributed.fsdp import FsdpTransport
from superoffload.distributed.zero import ZeroOffloadEngine
from superoffload.models import GPT, gpt_tiny
from superoffload.runtime.engine import OffloadEngine

GLOBAL_BATCH, SEQ = 4, 16
OPTIM = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def config(args: dict[str, Any]) -> OffloadConfig:
    return OffloadConfig(device="cpu", bucket_bytes=64 * 1024, ratio=1.0, speculation="on",
                         rollback="inverse", max_grad_norm=args.get("max_grad_norm", 0.5),
                         telemetry=False, watchdog_s=60.0)


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_tiny(n_layer=2, block_size=SEQ))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def train(net: torch.nn.Module, engine: OffloadEngine, batches: list, rank: int,
          world: int) -> list[float]:
    per, losses = GLOBAL_BATCH // world, []
    for x, y in batches:
        loss = net(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def scenario_engine(out: Path, args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    batches = data(int(args.get("steps", 6)))
    zero_model = model()
    zero = ZeroOffloadEngine(zero_model, OPTIM, config(args))
    zero_loss = train(zero_model, zero, batches, rank, world)
    zero_masters = zero.full_master_weights()
    zero_stats = zero.stats.as_dict()
    zero.close()

    net = model()
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in net.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(net, offload_policy=policy)
    engine = OffloadEngine(net, OPTIM, config(args), transport=FsdpTransport())
    fsdp_loss = train(net, engine, batches, rank, world)
    fsdp_masters = engine.master_weights()
    fsdp_stats = engine.stats.as_dict()
    engine.close()
    diff = max(float((fsdp_masters[n] - zero_masters[n]).abs().max()) for n in zero_masters)
    start = model()
    moved = max(float((zero_masters[n] - p.detach()).abs().max())
                for n, p in start.named_parameters())
    return {"zero_loss": zero_loss, "fsdp_loss": fsdp_loss, "master_diff": diff,
            "moved": moved, "zero_stats": zero_stats, "fsdp_stats": fsdp_stats,
            "names_equal": sorted(zero_masters) == sorted(fsdp_masters)}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    (out / f"pid_rank{os.environ['RANK']}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=60)
    try:
        result = {"engine": scenario_engine}[scenario](out, args, info.rank, info.world_size)
        if info.rank == 0:
            (out / f"{scenario}.json").write_text(json.dumps(result))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
