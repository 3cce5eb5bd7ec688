"""One rank of a data-parallel test of the FSDP2 engine (tests/test_fsdp_dp.py, via
_dist_support).

    python tests/_fsdp_dp_worker.py SCENARIO OUT_DIR ARGS_JSON

Each rank trains tests/_tiny_models.TinyGPT on its slice of every global batch with
FsdpOffloadEngine; rank 0 writes the results, the test compares them with plain PyTorch on
the whole global batch. Scenarios:
  train    args["runs"]: named engine settings; writes full fp32 master weights per run
           (with "mesh": [replicate, shard] an HSDP mesh; "mp": FSDP2's MixedPrecisionPolicy
           with a plain AdamW reference on an identical sharded model in this process)
  ckpt     train 2 steps (with an LR schedule), save a DCP checkpoint, train 2 more (W_a);
           then a fresh model, engine and scheduler load it and train the same 2 (W_b)
  resume   load args["ckpt"] on this world size, write the loaded state, train
           args["steps"] more steps, save to args["save_to"] when given
  dies     rank 1 exits abruptly in iteration 1; rank 0 must stop with DistributedError
  stall    rank 1 stops itself (SIGSTOP) after iteration 1; rank 0 must fail within the
           collective timeout, naming the stopped rank, and close() must return promptly
  ckptfail rank 1 cannot write its checkpoint file: every rank raises at once, no manifest
  reconfig every rank calls engine.reconfigure(bucket_bytes, max_grad_norm) after 2 steps
           (a re-plan and a live change), 2 more steps; then rank 1 asks for another
           max_grad_norm than rank 0: both must raise RanksDisagree before anything changes
  two_saves  save a checkpoint after 2 steps (OUT_DIR/a) and after 4 (OUT_DIR/b), so a test
           can mix the files of two saves of one run
  bound    args["runs"]: each rank's peak live gradient bytes (DeviceMeter) against its
           host-bucket shards, and whether offloaded .grad is None after backward
  several  args["do"]: [[scenario, args], ...] one after the other in one launch (a 4-process
           start costs ~20 s on 2 cores)
  plan     args["runs"]: each rank's FSDP2 collectives per optimizer step and its peak device
           bytes (tests/_fsdp_meter.py), for the planner's predictions (tests/test_plan_fsdp.py)
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
from superoffload.distributed.budget import HostMemoryError
from superoffload.distributed.fsdp import FsdpOffloadEngine

GLOBAL_BATCH, SEQ = 4, 12
LOCAL_KEYS = ("dtype", "two_groups", "host_available_bytes", "poison_step", "mesh", "mp")
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


def mesh_of(run: dict[str, Any]) -> Any:
    if "mesh" not in run:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(run["mesh"]), mesh_dim_names=("replicate", "shard"))


def mp_policy(run: dict[str, Any]) -> Any:
    if "mp" not in run:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param, reduce = (getattr(torch, d) for d in run["mp"])
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def build(run: dict[str, Any], seed: int = 0,
          mesh: Any = None) -> tuple[torch.nn.Module, FsdpOffloadEngine]:
    dtype = getattr(torch, run.get("dtype", "float32"))
    model = make_model(seed, dtype)
    groups = groups_for(model, bool(run.get("two_groups", False)), HYPER)
    engine = FsdpOffloadEngine(model, groups, make_config(run), mesh=mesh,
                               mp_policy=mp_policy(run),
                               host_available_bytes=run.get("host_available_bytes"))
    return model, engine


def train(model: torch.nn.Module, engine: FsdpOffloadEngine, data: list, start: int,
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


def stats_of(engine: FsdpOffloadEngine) -> dict[str, Any]:
    return engine.stats.as_dict()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as full tensors (FSDP2 holds DTensor shards). Collective."""
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def adamw_reference(run: dict[str, Any], data: list, steps: int, rank: int,
                    world: int) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW + clip_grad_norm_ on an identically sharded FSDP2 model (same
    MixedPrecisionPolicy): what the engine must reproduce, up to the optimizers' roundings."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(0)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy(run))
    fully_shard(model, mp_policy=mp_policy(run))
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(steps):
        x, y = data[step]
        model(local(x, rank, world), local(y, rank, world)).backward()
        if run.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), run["max_grad_norm"])
        opt.step()
        opt.zero_grad()
    return full_params(model)


def scenario_train(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    results: dict[str, Any] = {}
    data = global_data(3 * args["steps"])  # up to 3 micro-steps per step
    try:  # the host-memory check: every rank raises before allocating
        build({"host_available_bytes": 1})
        results["budget_error"] = None
    except HostMemoryError as exc:
        results["budget_error"] = str(exc)
    for name, run in args["runs"].items():
        t0 = time.monotonic()
        model, engine = build(run, mesh=mesh_of(run))
        train(model, engine, data, 0, args["steps"], rank, world,
              poison_step=run.get("poison_step"))
        weights = engine.full_master_weights()
        engine.synchronize()
        flow = engine.weights.flow
        results[name] = {"weights": weights, "stats": stats_of(engine),
                         "threads": engine.schedule.threads, "dp": engine.schedule.dp,
                         "local_world_size": engine.local_world_size,
                         "fetches": None if flow is None else flow.stats.fetches,
                         "n_blocks": None if flow is None else len(flow.blocks),
                         "on_host": None if flow is None else all(
                             p.device.type == "cpu" for ps in flow.params for p in ps)}
        engine.close()
        results[name]["params"] = full_params(model)
        if "mp" in run:
            results[name]["adamw"] = adamw_reference(run, data, args["steps"], rank, world)
        results[name]["seconds"] = time.monotonic() - t0
    if rank == 0:
        torch.save(results, out / f"train_{world}.pt")


def decay(optimizer: Any) -> Any:
    """The LR schedule of the checkpoint scenarios (tests/test_fsdp_dp.py uses it too)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))


def full_state(engine: FsdpOffloadEngine) -> dict[str, torch.Tensor]:
    """Masters and both moments, full tensors by "name/kind". Collective."""
    engine.synchronize()
    out = {}
    for i, s in engine.export_states().items():
        name = engine.state.names[i]
        for kind, t in (("master", s.master), ("exp_avg", s.exp_avg),
                        ("exp_avg_sq", s.exp_avg_sq)):
            out[f"{name}/{kind}"] = t.full_tensor()  # type: ignore[attr-defined]
    return out


def scenario_ckpt(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    run, ckpt = args["run"], str(out / args.get("name", "ckpt"))
    data = global_data(4)
    model, engine = build(run, mesh=mesh_of(run))
    sched = decay(engine.optimizer)
    train(model, engine, data, 0, 2, rank, world, scheduler=sched)
    w_save = full_state(engine)
    engine.save_checkpoint(ckpt, extra={"note": "after 2 steps"}, lr_scheduler=sched)
    train(model, engine, data, 2, 2, rank, world, scheduler=sched)
    w_a = engine.full_master_weights()
    engine.close()
    model_b, engine_b = build(run, seed=5, mesh=mesh_of(run))  # the load must overwrite
    sched_b = decay(engine_b.optimizer)
    extra = engine_b.load_checkpoint(ckpt, lr_scheduler=sched_b)
    iteration_loaded = engine_b.iteration
    w_loaded = full_state(engine_b)
    train(model_b, engine_b, data, 2, 2, rank, world, scheduler=sched_b)
    w_b = engine_b.full_master_weights()
    engine_b.close()
    if rank == 0:
        torch.save({"w_save": w_save, "w_loaded": w_loaded, "w_a": w_a, "w_b": w_b,
                    "extra": extra, "iteration_loaded": iteration_loaded,
                    "lr": sched_b.get_last_lr()}, out / f"{args.get('name', 'ckpt')}.pt")


def scenario_resume(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(4)
    model, engine = build(args["run"], seed=7)
    sched = decay(engine.optimizer)
    engine.load_checkpoint(args["ckpt"], lr_scheduler=sched)
    loaded = full_state(engine)
    train(model, engine, data, 2, args["steps"], rank, world, scheduler=sched)
    weights = engine.full_master_weights()
    if args.get("save_to"):
        engine.save_checkpoint(args["save_to"], lr_scheduler=sched)
    engine.close()
    if rank == 0:
        torch.save({"loaded": loaded, "weights": weights}, out / f"resume_{world}.pt")


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


def scenario_stall(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    import signal

    data = global_data(3)
    model, engine = build({"watchdog_s": 600.0})
    train(model, engine, data, 0, 1, rank, world)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    record: dict[str, Any] = {}
    try:
        train(model, engine, data, 1, 2, rank, world)
        engine.synchronize()
        record["error"] = None
    except Exception as exc:
        from superoffload.runtime.errors import EngineError

        record.update(error=str(exc), type=type(exc).__name__,
                      engine_error=isinstance(exc, EngineError))
    record["seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        engine.close()
    except Exception as exc:
        record["close_error"] = repr(exc)
    record["close_seconds"] = time.monotonic() - t1
    (out / "stall_rank0.json").write_text(json.dumps(record))
    os._exit(0)  # skip the process-group teardown with a stopped peer


def scenario_ckptfail(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    from superoffload.distributed.fsdp import checkpoint

    model, engine = build({})
    train(model, engine, global_data(1), 0, 1, rank, world)
    if rank == 1:
        def full_disk(payload: Any, final: str) -> Any:
            raise OSError(28, "No space left on device")
        checkpoint.write_atomic = full_disk  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(str(out / "ckpt"))
        record: dict[str, Any] = {"error": None}
    except OSError as exc:
        record = {"error": str(exc)}
    record["seconds"] = time.monotonic() - t0
    record["manifest"] = (out / "ckpt" / "manifest.json").exists()
    engine.close()
    (out / f"ckptfail_rank{rank}.json").write_text(json.dumps(record))


def scenario_reconfig(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    from superoffload.runtime.contract import RanksDisagree

    data = global_data(4)
    model, engine = build(args["run"])
    train(model, engine, data, 0, 2, rank, world)
    engine.reconfigure(**args["changes"])
    train(model, engine, data, 2, 2, rank, world)
    weights = engine.full_master_weights()
    plan = engine.schedule.bucket_table()
    try:
        engine.reconfigure(max_grad_norm=0.25 if rank else 0.35)
        error = None
    except RanksDisagree as exc:
        error = str(exc)
    record = {"weights": weights, "buckets": len(plan), "error": error,
              "max_grad_norm": engine.config.max_grad_norm,
              "reconfigurations": engine.stats.reconfigurations}
    engine.close()
    if rank == 0:
        torch.save(record, out / "reconfig.pt")


def scenario_two_saves(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(4)
    model, engine = build({"max_grad_norm": 0.5})
    train(model, engine, data, 0, 2, rank, world)
    engine.save_checkpoint(str(out / "a"), extra={"iteration": 2})
    train(model, engine, data, 2, 2, rank, world)
    engine.save_checkpoint(str(out / "b"), extra={"iteration": 4})
    engine.close()


def scenario_bound(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    """Per run of args["runs"]: this rank's peak bytes of live gradients during 2 steps
    (``DeviceMeter``, sampled at every save and around every bucket's departure), its
    largest and total host-bucket gradient shard, and whether every host-bucket parameter's
    ``.grad`` was None after backward."""
    from superoffload.runtime.device_meter import DeviceMeter

    results: dict[str, Any] = {}
    for name, run in args["runs"].items():
        model, engine = build(run)
        meter = DeviceMeter(model, engine=engine)
        departures = engine.launcher.departures
        depart = departures.depart

        def metered(*a: Any, depart: Any = depart, meter: Any = meter, **kw: Any) -> Any:
            meter.sample()  # the bucket's gradients are all alive here
            fut = depart(*a, **kw)
            meter.sample()
            return fut

        departures.depart = metered  # type: ignore[method-assign]
        host = [buf for buf in engine.state.buffers if not buf.on_device]
        shard_bytes = [sum(g.numel() for g in buf.grad_host) * 4 for buf in host]
        host_params = [i for buf in host for i in buf.bucket.param_indices]
        data, freed = global_data(2), []
        with meter.track():
            for step in range(2):
                x, y = data[step]
                engine.backward(model(local(x, rank, world), local(y, rank, world)))
                engine.synchronize()
                freed.append(all(engine.state.params[i].grad is None for i in host_params))
                engine.step()
                engine.zero_grad()
        results[name] = {"peak": meter.peak_grad_bytes, "bucket": max(shard_bytes),
                         "total": sum(shard_bytes), "buckets": len(host), "freed": freed}
        engine.close()
    (out / f"bound_rank{rank}.json").write_text(json.dumps(results))


def scenario_plan(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    from _fsdp_meter import measure_run

    results = {name: measure_run(run, rank, world) for name, run in args["runs"].items()}
    (out / f"plan_rank{rank}.json").write_text(json.dumps(results))


def scenario_several(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    for name, sub in args["do"]:
        SCENARIOS[name](out, rank, world, sub)


SCENARIOS = {"train": scenario_train, "ckpt": scenario_ckpt, "resume": scenario_resume,
             "dies": scenario_dies, "stall": scenario_stall, "ckptfail": scenario_ckptfail,
             "reconfig": scenario_reconfig, "two_saves": scenario_two_saves,
             "bound": scenario_bound, "several": scenario_several, "plan": scenario_plan}


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=float(args.get("timeout_s", 120)))
    SCENARIOS[scenario](out, info.rank, info.world_size, args)
    shutdown()


if __name__ == "__main__":
    main()
