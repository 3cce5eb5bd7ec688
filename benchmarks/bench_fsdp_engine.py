"""The offload engine over FSDP2 (``FsdpOffloadEngine``) against its peers, one run, 2 ranks:
``bench_fsdp.py --engine`` runs this (docs/distributed.md, "FSDP2 under the engine").

Arms (each its own copy of the model, the same initial weights and data):

* ``fsdp_engine``: ``FsdpOffloadEngine`` (the engine's transport over FSDP2: FSDP2
  reduce-scatters and all-gathers, the engine offloads, speculates and steps on the CPU);
* ``fsdp_cpu_adam``: plain FSDP2 with ``CPUOffloadPolicy`` and ``so.CPUAdam`` (no engine: the
  step waits for the whole backward, nothing overlaps);
* ``fsdp_engine_units``: the same engine with buckets that follow its FSDP2 units (the rule
  book's ``EngineVariant.buckets_per_unit``; the engine does not run it by default): the
  measured side of the planner's case for that rule (docs/planner.md, "Data parallel");
* ``one_process_engine``: each rank a single-process ``OffloadEngine`` on its own batch, no
  communication: the planner's error on this machine without data parallel, measured in the
  same run (its prediction: dp = 1 on this rank's share of the host).

The former ZeRO transport ran here as a third arm until it was removed; the table measured
against it is in docs/distributed.md ("Benchmark").

A round runs ``--block`` iterations per arm (forward, backward, step, zero_grad; the engine's
CPU step overlaps the next forward inside a block), then waits for every in-flight update
(``engine.synchronize()``), in a rotating order of the arms, so drifting load hits all alike;
the time per iteration is the block's wall time over ``--block``, rank 0's clock after a
barrier; medians over the rounds after ``--warmup``.

Beside each engine row the planner's prediction (``plan.simulate`` of this model at
``dp`` = the ranks, all on this host, with the arm's config, engine variant and the clipping
rate the run measured): the profile is ``--profile`` ("local":
``plan.measure_local(quick=True)``, cached, then ``plan.probe.probe_model`` for this model's
matmuls and passes; "none" skips it),
measured on rank 0 before the arms are built, with its collective figures fitted to this job's
own all-gathers and reduce-scatters (``collective_fit``: every rank times them together,
4 KB up to the model's fp32 bytes; the ring model's latency and bandwidth by least squares). On a
CPU machine the collectives are gloo's, which block the training thread: the planner models
them so (plan/sim_fsdp.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model(preset: str) -> torch.nn.Module:
    from superoffload.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    return GPT(PRESETS[preset]())


def _config(threads: int, bucket_bytes: int | None = None) -> Any:
    from superoffload.config import OffloadConfig

    cfg = OffloadConfig(device="cpu", cpu_threads=threads, max_grad_norm=1.0,
                        telemetry=False, watchdog_s=600.0)
    return cfg if bucket_bytes is None else cfg.replace(bucket_bytes=bucket_bytes)


class _Plain:
    """FSDP2 + CPUOffloadPolicy + so.CPUAdam behind the engine's three calls."""

    def __init__(self, model: torch.nn.Module, threads: int) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        import superoffload as so

        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        self.opt = so.CPUAdam(model.parameters(), threads=threads, **HYPER)
        self.model = model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        return None


def planner_profile(args: argparse.Namespace) -> Any:
    """The profile the prediction uses (module docstring); None: no prediction."""
    import json
    from pathlib import Path

    from superoffload import plan
    from superoffload.plan.probe import probe_model

    if args.profile == "none":
        return None
    if args.profile == "local":
        base = plan.measure_local(quick=True, progress=False)
    elif Path(args.profile).suffix == ".json":
        base = plan.HardwareProfile.from_dict(json.loads(Path(args.profile).read_text()))
    else:
        base = plan.profiles.get(args.profile)
    return probe_model(_shape(args, 1), base, trials=3)


def collective_fit(sizes: list[int], reps: int = 10) -> tuple[float, float]:
    """(latency s per ring step, GB/s) of this job's all-gather and reduce-scatter, timed on
    every rank together (medians of ``reps`` calls per size, rank 0's clock) and fitted to the
    ring model t = (N - 1) latency + (N - 1) / N bytes / bw (plan/parallel.py)."""
    import numpy as np
    import torch.distributed as dist

    world = dist.get_world_size()
    xs, ys = [], []
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        full, part = torch.zeros(numel), torch.zeros(numel // world)
        for op in ("all_gather", "reduce_scatter"):
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_gather":
                    dist.all_gather_into_tensor(full, part)
                else:
                    dist.reduce_scatter_tensor(part, full)
                times.append(time.perf_counter() - t0)
            xs.append((world - 1) / world * numel * 4)
            ys.append(statistics.median(times))
    slope, intercept = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
    return max(float(intercept), 1e-7) / (world - 1), 1e-9 / max(float(slope), 1e-15)


def _shape(args: argparse.Namespace, world: int) -> Any:
    from superoffload import plan

    shape = plan.ModelShape.from_module(_model(args.preset), seq=args.seq,
                                        micro_batch=args.batch, activation_checkpointing=False)
    return shape.replace(dp=world, ranks_per_host=world)


def predict(args: argparse.Namespace, world: int, prof: Any, stats: Any, *,
            one_process: bool = False, per_unit: bool = False) -> dict[str, Any]:
    """The planner's iteration of an engine arm on this machine (module docstring)."""
    import dataclasses

    from superoffload import plan
    from superoffload.plan.parallel import rank_profile
    from superoffload.plan.schedule import engine_for

    rate = stats.clipped_steps / max(1, stats.iterations)  # what this run clipped
    shape, machine, config = _shape(args, world), prof, _config(args.threads, args.bucket_bytes)
    if one_process:  # dp = 1 on this rank's share of the host
        shape, machine = shape.replace(dp=1, ranks_per_host=1), rank_profile(prof, world)
    variant = dataclasses.replace(engine_for(config), buckets_per_unit=per_unit)
    sim = plan.simulate(shape, machine, "superoffload", config,
                        plan.Techniques(rollback_rate=min(1.0, rate), engine=variant))
    return {"predicted_s": sim.iteration_s, "collective_s": sim.collective_s,
            "backend": sim.collective_backend, "rollback_rate": rate, "profile": prof.name,
            "collective_latency_s": prof.collective_latency_s,
            "collective_gbps": prof.collective_gbps}


def _per_unit_engine() -> type:
    """``FsdpOffloadEngine`` whose rule book cuts the buckets along its FSDP2 units."""
    import dataclasses

    from superoffload.distributed.fsdp import FsdpOffloadEngine

    class PerUnit(FsdpOffloadEngine):
        def facts(self) -> Any:
            facts = super().facts()
            index = {id(p): i for i, p in enumerate(self.state.params)}
            units = tuple(tuple(sorted(index[id(p)] for p in u.params if id(p) in index))
                          for u in self.units)
            return dataclasses.replace(facts, units=units, engine=dataclasses.replace(
                facts.engine, buckets_per_unit=True))

    return PerUnit


def build_arms(preset: str, threads: int, bucket_bytes: int | None = None
               ) -> dict[str, tuple[torch.nn.Module, Any]]:
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    arms: dict[str, tuple[torch.nn.Module, Any]] = {}
    config = _config(threads, bucket_bytes)
    model = _model(preset)
    arms["fsdp_engine"] = (model, FsdpOffloadEngine(model, dict(HYPER), config))
    model = _model(preset)
    arms["fsdp_engine_units"] = (model, _per_unit_engine()(model, dict(HYPER), config))
    model = _model(preset)
    arms["fsdp_cpu_adam"] = (model, _Plain(model, threads))
    from superoffload.runtime.engine import OffloadEngine  # so.initialize would shard it

    model = _model(preset)
    arms["one_process_engine"] = (model, OffloadEngine(model, dict(HYPER), config))
    return arms


def run_engines(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from superoffload.kernels.adam_bench import rotated
    from superoffload.models.gpt import PRESETS

    cfg = PRESETS[args.preset]()
    prof = planner_profile(args) if rank == 0 else None  # before any arm exists
    dist.barrier()
    if args.profile != "none":  # from a small message up to the whole model's fp32 bytes
        numel = sum(p.numel() for p in _model(args.preset).parameters())
        latency, gbps = collective_fit([4096, numel, 4 * numel])
        if prof is not None:
            prof = prof.replace(collective_latency_s=latency, collective_gbps=gbps)
    arms = build_arms(args.preset, args.threads, args.bucket_bytes)
    g = torch.Generator().manual_seed(1 + rank)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.warmup + args.rounds):
        batches = [(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
                    torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g))
                   for _ in range(args.block)]
        for name in rotated(list(arms), r):
            model, engine = arms[name]
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in batches:
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) / args.block)
    predicted = {}
    if prof is not None:
        predicted = {"fsdp_engine": predict(args, world, prof, arms["fsdp_engine"][1].stats),
                     "fsdp_engine_units": predict(args, world, prof,
                                                  arms["fsdp_engine_units"][1].stats,
                                                  per_unit=True),
                     "one_process_engine": predict(args, world, prof,
                                                   arms["one_process_engine"][1].stats,
                                                   one_process=True)}
    for _, engine in arms.values():
        if hasattr(engine, "close"):
            engine.close()
    params = sum(p.numel() for p in _model(args.preset).parameters())
    return {"rank": rank, "world": world, "preset": args.preset, "params": params,
            "seq": args.seq, "batch": args.batch, "rounds": args.rounds, "block": args.block,
            "threads": args.threads, "torch": torch.__version__,
            "bucket_bytes": arms["fsdp_engine"][1].config.bucket_bytes,
            "units": len(arms["fsdp_engine"][1].units),
            "median_s": {n: statistics.median(t) for n, t in times.items()},
            "all_s": times, "predicted": predicted}


def engine_table(res: dict[str, Any]) -> str:
    med = res["median_s"]
    base = med["fsdp_cpu_adam"]
    rows = ["| arm | iteration ms (median) | vs fsdp_cpu_adam | predicted ms | predicted / "
            "measured |", "|---|---|---|---|---|"]
    notes = []
    for name, s in med.items():
        pred = res.get("predicted", {}).get(name)
        cells = (f"{pred['predicted_s'] * 1e3:.1f} | {pred['predicted_s'] / s:.2f}"
                 if pred else "- | -")
        rows.append(f"| {name} | {s * 1e3:.1f} | {s / base:.2f}x | {cells} |")
        if pred and pred["backend"]:
            notes.append(f"{name}: planner profile {pred['profile']}, collectives "
                         f"{pred['backend']} (fitted here: "
                         f"{pred['collective_latency_s'] * 1e6:.0f} us per ring step, "
                         f"{pred['collective_gbps']:.2f} GB/s; "
                         f"{pred['collective_s'] * 1e3:.1f} ms per iteration predicted), "
                         f"clipping rate {pred['rollback_rate']:.2f}")
    head = (f"{res['preset']}: {res['params'] / 1e6:.2f} M parameters, {res['world']} ranks, "
            f"batch {res['batch']} x {res['seq']} tokens per rank, {res['rounds']} rounds of "
            f"{res['block']} iterations per arm, {res['threads']} thread(s) per rank, "
            f"bucket_bytes {res['bucket_bytes']:,} ({res['units']} FSDP2 units), torch "
            f"{res['torch']}")
    return head + "\n\n" + "\n".join(rows + [""] + notes)
