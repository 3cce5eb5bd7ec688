"""Validation and settling of one data-parallel iteration (paper §4.3 STV, per shard).

``validate``: each rank sums the partials of its own gradient shards (disjoint, so the sum
over ranks is the global sum of squares) plus, on rank 0 only, the replicated tail buckets
(already all-reduced, identical on every rank: counted once); one all-reduce of
[sum of squares, non-finite count] gives every rank the same numbers, hence the same
verdict. The reduced gradient is the *sum* over N ranks, so its squared norm is divided by
N^2 and the kernel's factor carries 1/N (zero.py).

``settle``: COMMIT keeps the speculative shard steps; CLIP rolls each shard back and
replays it with the clipped factor; SKIP rolls back; a rollback or (re)play is followed by
an all-gather so the parameters show the settled weights. The tail is stepped on the
device on every rank.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from superoffload.distributed.launch import collective_guard
from superoffload.runtime.iteration import close_iteration as shared_close_iteration
from superoffload.runtime.steps import KernelCall, RollbackTask, run_calls
from superoffload.runtime.stv import Action, Verdict, verdict
from superoffload.telemetry.events import (
    KIND_DEVICE_STEP,
    KIND_VALIDATE,
    LANE_COMPUTE,
    LANE_DEVICE_OPT,
)

if TYPE_CHECKING:
    from superoffload.distributed.zero import ZeroOffloadEngine


@dataclass(slots=True)
class Flight:
    """A bucket in flight during one iteration (training-thread bookkeeping)."""

    bucket: int
    calls: tuple[KernelCall, ...]
    on_device: bool = False
    work: Any = None
    """Tail buckets: the all-reduce of the gradient."""
    reduce: Future[Any] | None = None
    """Sharded buckets: the ReduceTask's future (GradStats of the shard)."""
    spec: Future[Any] | None = None
    spec_scale: float = 1.0


def tail_views(engine: ZeroOffloadEngine, b: int) -> list[torch.Tensor]:
    """The all-reduced tail gradient, one view per parameter (bucket order)."""
    flat, out, offset = engine._tail_grads[b], [], 0
    for p in engine._tails[b].params:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def _count(engine: ZeroOffloadEngine, name: str) -> Any:
    def done(fut: Future[Any]) -> None:
        if fut.exception() is None and fut.result() is True:
            with engine._error_lock:
                setattr(engine.stats, name, getattr(engine.stats, name) + 1)
    return done


def validate(engine: ZeroOffloadEngine, flights: list[Flight]) -> Verdict:
    rec, t0 = engine.telemetry, engine.telemetry.now()
    sum_sq, nonfinite = 0.0, 0
    for fl in flights:
        if fl.on_device:
            with collective_guard(f"all_reduce of tail bucket {fl.bucket}", engine.grad_group):
                fl.work.wait()
            stats = engine.backend.device_stats(tail_views(engine, fl.bucket))
            if engine.rank == 0:
                sum_sq += stats.sum_sq
        else:
            assert fl.reduce is not None, "every sharded bucket is issued before validation"
            if fl.spec is not None:
                fl.spec.add_done_callback(_count(engine, "speculated_buckets"))
            stats = engine._wait(fl.reduce, f"reduce of bucket {fl.bucket}")
            sum_sq += stats.sum_sq
        if stats.nonfinite:
            engine.stats.nonfinite_buckets += 1
        nonfinite += stats.nonfinite
    totals = torch.tensor([sum_sq, float(nonfinite)], dtype=torch.float64,
                          device=engine.backend.device)
    with collective_guard("all_reduce (validation)", engine.grad_group):
        dist.all_reduce(totals, group=engine.grad_group)
    n = engine.world_size
    v = verdict(float(totals[0]) / n**2, int(totals[1]), loss_scale=engine.scaler.loss_scale,
                max_grad_norm=engine.config.max_grad_norm)
    rec.add(LANE_COMPUTE, KIND_VALIDATE, t0, rec.now(), iteration=engine.iteration)
    return v


def settle(engine: ZeroOffloadEngine, flights: list[Flight], v: Verdict) -> None:
    cfg, rec = engine.config, engine.telemetry
    scale = v.grad_scale / engine.world_size
    for fl in flights:
        if fl.on_device:
            if v.action is not Action.SKIP:
                buf = engine._tails[fl.bucket]
                with torch.no_grad(), rec.span(LANE_DEVICE_OPT, KIND_DEVICE_STEP,
                                               iteration=engine.iteration, bucket=fl.bucket,
                                               nbytes=28 * buf.bucket.numel):
                    run_calls(buf, fl.calls, tail_views(engine, fl.bucket), grad_scale=scale,
                              threads=None)
            continue
        shard = engine._shards[fl.bucket].state
        if fl.spec is not None and v.action is not Action.COMMIT:
            rollback = engine.worker.submit(RollbackTask(
                bucket=fl.bucket, iteration=engine.iteration, buffers=shard, calls=fl.calls,
                grad_scale=fl.spec_scale, threads=engine.threads, step_future=fl.spec,
                mode=cfg.rollback, recorder=rec, watchdog_s=cfg.watchdog_s))
            rollback.add_done_callback(_count(engine, "rollbacks"))
            if v.action is Action.SKIP:
                engine.gather(fl.bucket, after=rollback)  # publish the restored weights
        if v.action is Action.SKIP:
            continue
        if fl.spec is None or v.action is Action.CLIP:
            replay = fl.spec is not None
            step = engine.worker.submit(engine.step_task(fl, scale=scale, after=None,
                                                         speculative=False, replay=replay))
            if replay:
                step.add_done_callback(_count(engine, "replays"))
            engine.gather(fl.bucket, after=step)
    if v.action is not Action.SKIP:
        for i in engine._trainable:  # every parameter steps (a missing gradient is zero)
            engine._steps[i] += 1


def close_iteration(engine: ZeroOffloadEngine, v: Verdict) -> None:
    """The single-process engine's end-of-iteration book-keeping; every rank holds the same
    verdict, so an overflow skips the step everywhere."""
    shared_close_iteration(engine, v, engine.scaler.loss_scale,
                           overflow=f"overflow on some rank: step skipped on all "
                                    f"{engine.world_size} ranks")
