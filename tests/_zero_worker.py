"""One rank of a ZeRO data-parallel test (run by tests/test_zero_dp.py via _dist_support).

    python tests/_zero_worker.py SCENARIO OUT_DIR ARGS_JSON

Each rank trains tests/_tiny_models.TinyGPT on its slice of every global batch with
ZeroOffloadEngine; rank 0 writes the results, the test compares them with plain PyTorch
on the whole global batch. Scenarios:
  train    args["runs"]: named engine settings; writes full fp32 master weights per run
  ckpt     train 2 steps (with an LR schedule), save a sharded checkpoint, train 2 more
           (W_a); then a fresh model, engine and scheduler load the checkpoint and train the
           same 2 steps (W_b: must equal W_a)
  resume   load args["ckpt"] on this world size, train args["steps"] more steps, and save
           to args["save_to"] when given
  dies     rank 1 exits abruptly in iteration 1; rank 0 must stop with DistributedError
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _engine_ref import HYPER, groups_for
from _tiny_models import batches, make_model

from superoffload.config import OffloadConfig
from superoffload.distributed import DistributedError, init_distributed, shutdown
from superoffload.distributed.zero import ZeroOffloadEngine
from superoffload.distributed.zero.budget import HostMemoryError

GLOBAL_BATCH, SEQ = 4, 12
LOCAL_KEYS = ("reduce_mode", "dtype", "two_groups", "host_available_bytes", "poison_step")
"""Keys of a run that are not OffloadConfig fields."""


def make_config(run: dict[str, Any]) -> OffloadConfig:
    base = {"device": "cpu", "bucket_bytes": 4096, "ratio": 0.8, "speculation": "on",
            "rollback": "inverse", "max_grad_norm": None, "telemetry": False,
            "watchdog_s": 60.0}
    base.update({k: v for k, v in run.items() if k not in LOCAL_KEYS})
    return OffloadConfig(**base)


def global_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(n, seed=1, batch=GLOBAL_BATCH, seq=SEQ)


def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world
    return batch[rank * per:(rank + 1) * per]


def build(run: dict[str, Any], seed: int = 0) -> tuple[torch.nn.Module, ZeroOffloadEngine]:
    dtype = getattr(torch, run.get("dtype", "float32"))
    model = make_model(seed, dtype)
    groups = groups_for(model, bool(run.get("two_groups", False)), HYPER)
    engine = ZeroOffloadEngine(model, groups, make_config(run),
                               reduce_mode=run.get("reduce_mode", "auto"),
                               host_available_bytes=run.get("host_available_bytes"))
    return model, engine


def train(model: torch.nn.Module, engine: ZeroOffloadEngine, data: list, start: int,
          steps: int, rank: int, world: int, poison_step: int | None = None,
          scheduler: Any = None) -> None:
    """``poison_step``: the last rank's loss becomes inf in that step (an overflow on one
    rank: every rank must skip the step)."""
    gas = engine.config.grad_accum_steps
    for step in range(start, start + steps):
        for micro in range(gas):
            x, y = data[step * gas + micro]
            loss = model(local(x, rank, world), local(y, rank, world))
            if step == poison_step and rank == world - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()


def stats_of(engine: ZeroOffloadEngine) -> dict[str, Any]:
    return {k: getattr(engine.stats, k) for k in engine.stats.__slots__}  # type: ignore[attr-defined]


def scenario_train(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    results: dict[str, Any] = {}
    data = global_data(2 * args["steps"])
    try:  # the host-memory check: every rank raises before allocating
        build({"host_available_bytes": 1})
        results["budget_error"] = None
    except HostMemoryError as exc:
        results["budget_error"] = str(exc)
    for name, run in args["runs"].items():
        model, engine = build(run)
        train(model, engine, data, 0, args["steps"], rank, world,
              poison_step=run.get("poison_step"))
        weights = engine.full_master_weights()
        engine.synchronize()
        flow = engine.weights.flow  # weight-flow: close() makes every block resident again
        results[name] = {"weights": weights, "stats": stats_of(engine),
                         "mode": engine.reduce_mode, "threads": engine.schedule.threads,
                         "local_world_size": engine.local_world_size,
                         "fetches": None if flow is None else flow.stats.fetches,
                         "n_blocks": None if flow is None else len(flow.blocks),
                         "released": None if flow is None else
                         [p.numel() for ps in flow.params for p in ps]}
        engine.close()
        results[name]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(results, out / "train.pt")


def decay(optimizer: Any) -> Any:
    """The LR schedule of the checkpoint scenarios (tests/test_zero_dp.py uses it too)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))


def scenario_ckpt(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    run, ckpt = args["run"], str(out / "ckpt")
    data = global_data(4)
    model, engine = build(run)
    sched = decay(engine.optimizer)
    train(model, engine, data, 0, 2, rank, world, scheduler=sched)
    w_save = engine.full_master_weights()
    engine.save_checkpoint(ckpt, extra={"note": "after 2 steps"}, lr_scheduler=sched)
    train(model, engine, data, 2, 2, rank, world, scheduler=sched)
    w_a = engine.full_master_weights()
    stats_a = stats_of(engine)
    engine.close()
    model_b, engine_b = build(run, seed=5)  # other initial weights: the load must overwrite
    sched_b = decay(engine_b.optimizer)
    extra = engine_b.load_checkpoint(ckpt, lr_scheduler=sched_b)
    iteration_loaded = engine_b.iteration
    train(model_b, engine_b, data, 2, 2, rank, world, scheduler=sched_b)
    w_b = engine_b.full_master_weights()
    engine_b.close()
    if rank == 0:
        torch.save({"w_save": w_save, "w_a": w_a, "w_b": w_b, "extra": extra,
                    "iteration_loaded": iteration_loaded, "stats_a": stats_a}, out / "ckpt.pt")


def scenario_resume(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(4)
    model, engine = build(args["run"], seed=7)
    sched = decay(engine.optimizer)
    engine.load_checkpoint(args["ckpt"], lr_scheduler=sched)
    train(model, engine, data, 2, args["steps"], rank, world, scheduler=sched)
    weights = engine.full_master_weights()
    if args.get("save_to"):
        engine.save_checkpoint(args["save_to"], lr_scheduler=sched)
    engine.close()
    if rank == 0:
        torch.save({"weights": weights}, out / f"resume_{world}.pt")


def scenario_dies(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(3)
    model, engine = build(args["run"])
    train(model, engine, data, 0, 1, rank, world)
    if rank == 1:
        os._exit(7)  # like the OOM killer: no cleanup, no goodbye
    t0 = time.monotonic()
    record: dict[str, Any]
    try:
        train(model, engine, data, 1, 2, rank, world)
        engine.synchronize()
        record = {"error": None}
    except DistributedError as exc:
        record = {"error": str(exc), "type": type(exc).__name__}
    except Exception as exc:  # the test fails on this: the error must be a DistributedError
        record = {"error": repr(exc), "type": type(exc).__name__}
    record["seconds"] = time.monotonic() - t0
    (out / "dies_rank0.json").write_text(json.dumps(record))
    os._exit(0)  # skip teardown with a dead peer


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=float(args.get("timeout_s", 60)))
    fn = {"train": scenario_train, "ckpt": scenario_ckpt, "resume": scenario_resume,
          "dies": scenario_dies}[scenario]
    fn(out, info.rank, info.world_size, args)
    shutdown()


if __name__ == "__main__":
    main()
