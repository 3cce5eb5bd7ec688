"""One rank of a dp x sp test (run by tests/test_dp_sp.py via _dist_support.run_ranks).

    python tests/_dp_sp_worker.py SCENARIO OUT_DIR ARGS_JSON

Both scenarios train our GPT made sequence-parallel with Ulysses (apply_ulysses over the sp
group); every rank of an sp group reads the same global batch and keeps its contiguous 1/sp
slice of every sequence (split_sequence). The test compares with one process on the full
sequences. Scenarios:
  fsdp_sp  FsdpOffloadEngine over the job's mesh: FSDP2 shards the model and the optimizer
           state over the flattened (dp_shard, sp) dimensions, every rank; Ulysses'
           all-to-all runs on the mesh's sp dimension; gradients of the local-mean losses
           averaged over all ranks
  fsdp_flow_sp  the same under weight-flow (the block units' shards on the host)
  flow_sp  the single-process OffloadEngine under weight-flow on every rank (replicated
           state), gradients averaged over the ranks inside backward
           (average_gradients_in_backward) before the engine takes them
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from _engine_ref import HYPER, groups_for

from superoffload.config import OffloadConfig
from superoffload.distributed import (
    apply_ulysses,
    average_gradients_in_backward,
    get_groups,
    init_distributed,
    mean_over_group,
    shutdown,
    split_sequence,
)
from superoffload.models import GPT, gpt_tiny

BATCH, SEQ, STEPS = 2, 32, 4


def make_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_tiny(n_head=4))  # 4 heads: sp=2 gives each rank 2; dropout is 0


def global_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full (unsplit) batches; targets are the next token, shifted before any split."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        seq = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def dp_config(**changes: Any) -> OffloadConfig:
    base: dict[str, Any] = {"device": "cpu", "bucket_bytes": 64 << 10, "ratio": 0.8,
                            "speculation": "on", "rollback": "inverse", "max_grad_norm": 0.5,
                            "telemetry": False, "watchdog_s": 60.0, "pin_memory": False}
    base.update(changes)
    return OffloadConfig(**base)


def flow_config(**changes: Any) -> OffloadConfig:
    return dp_config(weights="flow", prefetch_depth=1, ratio=1.0, **changes)


def _train(model: GPT, engine: Any, steps: int) -> list[float]:
    sp = get_groups().sp_group
    losses = []
    for x, y in global_data(steps):
        loss = model(split_sequence(x, sp), split_sequence(y, sp))  # mean over local tokens
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(float(mean_over_group(loss, get_groups().world_group)))
    return losses


def scenario_fsdp_sp(out: Path, rank: int, args: dict[str, Any]) -> None:
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    flow = bool(args.get("flow"))
    model = apply_ulysses(make_gpt(seed=rank), get_groups().sp_group)  # rank 0's weights win
    config = flow_config() if flow else dp_config()
    with FsdpOffloadEngine(model, groups_for(model, False, HYPER), config) as engine:
        losses = _train(model, engine, STEPS)
        weights = engine.full_master_weights()
        engine.synchronize()
        fl = engine.weights.flow
        record = {"weights": weights, "losses": losses, "world": engine.world_size,
                  "fetches": None if fl is None else fl.stats.fetches,
                  "blocks": None if fl is None else len(fl.blocks),
                  "on_host": None if fl is None else all(
                      p.device.type == "cpu" for ps in fl.params for p in ps),
                  "stats": {k: getattr(engine.stats, k)
                            for k in ("iterations", "clipped_steps", "rollbacks", "replays")},
                  "sp_mesh_dim": get_groups().mesh.root["sp"].size()}
    record["params"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    torch.save(record, out / f"{'fsdp_flow_sp' if flow else 'fsdp_sp'}_rank{rank}.pt")


def scenario_flow_sp(out: Path, rank: int, args: dict[str, Any]) -> None:
    from superoffload.runtime.engine import OffloadEngine

    model = apply_ulysses(make_gpt(seed=0), get_groups().sp_group)  # replicas start equal
    handles = average_gradients_in_backward(model.parameters(), get_groups().world_group)
    # one single-process engine per rank (so.initialize under torchrun would be FSDP2's)
    with OffloadEngine(model, groups_for(model, False, HYPER), flow_config()) as engine:
        assert engine.weights.active == "flow", engine.weights.active
        losses = _train(model, engine, STEPS)
        weights = engine.master_weights()
        fetches = engine.weights.flow.stats.fetches if engine.weights.flow else 0
    for h in handles:
        h.remove()
    torch.save({"weights": weights, "losses": losses, "fetches": fetches},
               out / f"flow_sp_rank{rank}.pt")


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=60.0, sp=int(args.get("sp", 2)))
    {"fsdp_sp": scenario_fsdp_sp, "flow_sp": scenario_flow_sp}[scenario](out, info.rank, args)
    shutdown()


if __name__ == "__main__":
    main()
