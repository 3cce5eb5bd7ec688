"""One rank of the data-parallel contract tests (tests/test_contract_dp.py).

    python tests/_contract_worker.py SCENARIO OUT_DIR ARGS_JSON

Scenarios (each rank writes ``result_rank{r}.json``: the error's type and text, or None):
  mismatch  rank 1 differs in args["field"] (lr, weight_decay, width, ratio, bucket_bytes,
            frozen, max_grad_norm); every rank must raise RanksDisagree at construction,
            naming it
  midrun    rank 1's args["key"] of param group 0 (default lr: halved; weight_decay: 0.2)
            changes after 2 steps (a scheduler stepped on one rank only): every rank must
            raise RanksDisagree at the next step
  clipnorm  3 steps of engine.clip_grad_norm_(0.05) before step(); rank 0 writes the norms
            it returned and the fp32 masters
  edit      rank 1 scales its gradients between backward() and step(): every rank must raise
            GradientEdited, and the iteration is rolled back on both
  write     both ranks train 2 steps, load the weights saved after step 1 into the model
            (model.load_state_dict), train 2 more; rank 0 writes the fp32 masters
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from _engine_ref import HYPER
from _fsdp_dp_worker import global_data, local, make_config
from _tiny_models import make_model

from superoffload.distributed import init_distributed, shutdown
from superoffload.distributed.fsdp import FsdpOffloadEngine

BUILT: list[FsdpOffloadEngine] = []
"""Engines this rank built: closed before the process group goes, as a training script
ends (an engine left open after an error can still hold a collective in flight, and
tearing the group down under it aborts the process at exit)."""


def build(rank: int, args: dict[str, Any]) -> tuple[torch.nn.Module, FsdpOffloadEngine]:
    field, odd = args.get("field"), rank == 1
    kw: dict[str, Any] = {}
    if odd and field == "width":
        kw["dim"] = 32
    if odd and field == "frozen":
        kw["frozen"] = True
    model = make_model(0, **kw)
    run: dict[str, Any] = {"max_grad_norm": 1.0}
    if odd and field == "ratio":
        run["ratio"] = 0.5
    if odd and field == "bucket_bytes":
        run["bucket_bytes"] = 8192
    if odd and field == "max_grad_norm":
        run["max_grad_norm"] = 0.5
    hyper = dict(HYPER)
    if odd and field == "lr":
        hyper["lr"] = HYPER["lr"] * 2
    if odd and field == "weight_decay":  # HYPER's is 0.1
        hyper["weight_decay"] = 0.2
    engine = FsdpOffloadEngine(model, hyper, make_config(run))
    BUILT.append(engine)
    return model, engine


def step(model: torch.nn.Module, engine: FsdpOffloadEngine, batch: Any, rank: int,
         world: int, edit: bool = False) -> None:
    x, y = batch
    engine.backward(model(local(x, rank, world), local(y, rank, world)))
    if edit:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
    engine.step()
    engine.zero_grad()


def record(out: Path, rank: int, exc: BaseException | None, **extra: Any) -> None:
    data = {"type": None if exc is None else type(exc).__name__,
            "error": None if exc is None else str(exc), **extra}
    (out / f"result_rank{rank}.json").write_text(json.dumps(data))


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=30.0)
    world = info.world_size
    data = global_data(6)
    try:
        if scenario == "mismatch":
            build(rank, args)
            record(out, rank, None)
        elif scenario == "midrun":
            model, engine = build(rank, {})
            for k in range(2):
                step(model, engine, data[k], rank, world)
            if rank == 1:
                key, group = args.get("key", "lr"), engine.optimizer.param_groups[0]
                group[key] = group[key] * 0.5 if key == "lr" else 0.2
            step(model, engine, data[2], rank, world)
            record(out, rank, None)
        elif scenario == "clipnorm":
            model, engine = build(rank, {})
            norms = []
            for k in range(3):
                x, y = data[k]
                engine.backward(model(local(x, rank, world), local(y, rank, world)))
                norms.append(float(engine.clip_grad_norm_(0.05)))
                engine.step()
                engine.zero_grad()
            weights = engine.full_master_weights()
            if rank == 0:
                torch.save(weights, out / "clipnorm.pt")
            record(out, rank, None, norms=norms)
        elif scenario == "edit":
            model, engine = build(rank, {})
            step(model, engine, data[0], rank, world)
            before = engine.full_master_weights()
            try:
                step(model, engine, data[1], rank, world, edit=rank == 1)
                record(out, rank, None)
            except Exception as exc:
                after = engine.full_master_weights()
                diff = max(float((after[n] - before[n]).abs().max()) for n in before)
                record(out, rank, exc, rolled_back=diff)
        elif scenario == "write":
            model, engine = build(rank, {})
            step(model, engine, data[0], rank, world)
            engine.synchronize()
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            step(model, engine, data[1], rank, world)
            model.load_state_dict(saved)
            for k in (2, 3):
                step(model, engine, data[k], rank, world)
            weights = engine.full_master_weights()
            if rank == 0:
                torch.save(weights, out / "write.pt")
            record(out, rank, None)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception as exc:
        record(out, rank, exc)
    finally:
        for engine in BUILT:
            engine.close()  # after an error too: the engine's contract says close() completes
    shutdown()


if __name__ == "__main__":
    main()
