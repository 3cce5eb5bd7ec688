"""One iteration's bucket lifecycle: launch at backward, validate and settle at step().

Lifecycle of an offloaded (host) bucket, paper §4.2-4.3 / DESIGN.md §3:

1. its last gradient is final (post-accumulate-grad hook) -> ``launch_bucket``:
   D2H task (gradients -> pinned host buffer, local sum of squares + non-finite count);
   if speculating: a speculative CPU step that waits for that D2H (skipped when the
   bucket's own gradient is non-finite), then an H2D of the new weights;
2. ``finish_iteration`` (in ``step()``): sum the local statistics -> ``stv.verdict``:
   COMMIT keeps speculative steps (non-speculated buckets step now); CLIP rolls them back
   and replays with the clipped gradient still in the host buffer; SKIP rolls back and
   publishes the restored weights;
3. the next forward waits, per module, only for that bucket's last H2D.

GPU tail buckets skip D2H and are stepped on the device with the verdict's factor.
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from superoffload.runtime.backend import GradStats
from superoffload.runtime.optim_view import hyper_of
from superoffload.runtime.state import BucketBuffers
from superoffload.runtime.steps import KernelCall, RollbackTask, StepTask, device_step
from superoffload.runtime.stv import Action, verdict
from superoffload.runtime.transfers import D2HTask, H2DTask
from superoffload.telemetry.events import KIND_VALIDATE, LANE_COMPUTE

if TYPE_CHECKING:
    from superoffload.runtime.engine import OffloadEngine


@dataclass(frozen=True, slots=True)
class Barrier:
    """A no-op task: once it ran, everything submitted before it on that lane has run."""

    def run(self) -> None:
        return None


@dataclass(slots=True)
class Flight:
    """A bucket in flight during one iteration (training-thread bookkeeping)."""

    bucket: int
    members: tuple[int, ...] = ()
    calls: tuple[KernelCall, ...] = ()
    on_device: bool = False
    d2h: Future[Any] | None = None
    spec: Future[Any] | None = None
    spec_scale: float = 1.0

    @classmethod
    def placeholder(cls, bucket: int) -> Flight:
        """Reserves the slot while the launch is being built (hooks may fire concurrently)."""
        return cls(bucket)


def default_threads(cores_frac: float) -> int:
    return max(1, int((os.cpu_count() or 1) * cores_frac))


def _calls(engine: OffloadEngine, buf: BucketBuffers, members: tuple[int, ...]) -> tuple[KernelCall, ...]:
    """Group members by (param group, next step count); hyperparameters read now."""
    groups = engine.optimizer.param_groups
    keyed: dict[tuple[int, int], list[int]] = defaultdict(list)
    for pos in members:
        index = buf.bucket.param_indices[pos]
        keyed[(engine._group_of[index], engine._steps[index] + 1)].append(pos)
    return tuple(
        KernelCall(tuple(pos), step, hyper_of(groups[g])) for (g, step), pos in sorted(keyed.items())
    )


def _submit_h2d(engine: OffloadEngine, buf: BucketBuffers, members: tuple[int, ...],
                after: Future[Any]) -> None:
    flow = engine.weights.flow
    if flow is not None:
        # weight-flow: streamed weights are not on the device; their next fetch waits for
        # this step (runtime/weightflow.py). Only the resident members are copied.
        engine._home_ready[buf.bucket.id] = after
        members = tuple(i for i in members if not flow.is_streamed(buf.params[i]))
        if not members:
            return
    src_all = buf.lp_host if buf.lp_host is not None else buf.master
    task = H2DTask(
        bucket=buf.bucket.id, iteration=engine.iteration,
        src_host=tuple(src_all[i] for i in members),
        dst_device=tuple(buf.params[i].data for i in members),
        after=after, backend=engine.backend, recorder=engine.telemetry,
        watchdog_s=engine.config.watchdog_s,
    )
    engine._h2d_pending[buf.bucket.id] = engine.h2d_lane.submit(task)


def _counter(engine: OffloadEngine, name: str) -> Any:
    def done(fut: Future[Any]) -> None:
        if fut.exception() is None and fut.result() is True:
            with engine._hook_lock:
                setattr(engine.stats, name, getattr(engine.stats, name) + 1)
    return done


def _step_task(engine: OffloadEngine, fl: Flight, buf: BucketBuffers, *, scale: float,
               after: Future[Any] | None, speculative: bool, replay: bool) -> StepTask:
    return StepTask(
        bucket=fl.bucket, iteration=engine.iteration, buffers=buf, calls=fl.calls,
        grad_scale=scale, threads=engine.threads, after=after, skip_nonfinite=speculative,
        snapshot=speculative and engine.config.rollback == "snapshot", replay=replay,
        recorder=engine.telemetry, watchdog_s=engine.config.watchdog_s,
    )


def launch_bucket(engine: OffloadEngine, b: int) -> Flight:
    """Start a bucket whose gradients are final (step 1 of the lifecycle)."""
    buf = engine._buffers[b]
    members = tuple(pos for pos, p in enumerate(buf.params) if p.grad is not None)
    fl = Flight(b, members, _calls(engine, buf, members), on_device=buf.on_device)
    if buf.on_device or not members:
        return fl
    fl.d2h = engine.d2h_lane.submit(D2HTask(
        bucket=b, iteration=engine.iteration,
        grads=tuple(buf.params[i].grad for i in members),  # type: ignore[misc]
        grad_host=tuple(buf.grad_host[i] for i in members),
        ready=engine.backend.ready_token(), backend=engine.backend, recorder=engine.telemetry,
    ))
    flow = engine.weights.flow
    if flow is not None:  # weight-flow: the gradient has left, free its device copy (§4.5)
        for i in members:
            if flow.is_streamed(buf.params[i]):
                buf.params[i].grad = None
    if engine._it.speculate:
        if engine.config.rollback == "snapshot":
            buf.ensure_snapshot(engine.backend.alloc_host)
        fl.spec_scale = 1.0 / engine.scaler.loss_scale
        fl.spec = engine.worker.submit(
            _step_task(engine, fl, buf, scale=fl.spec_scale, after=fl.d2h, speculative=True,
                       replay=False))
        fl.spec.add_done_callback(_counter(engine, "speculated_buckets"))
        _submit_h2d(engine, buf, members, fl.spec)
    return fl


def finish_iteration(engine: OffloadEngine) -> None:
    """Validate, settle every bucket, step the tail on the device (steps 2-3)."""
    it, cfg, rec = engine._it, engine.config, engine.telemetry
    t0 = rec.now()
    flights = [it.flights[b] for b in sorted(it.flights)]
    # GPU tail buckets: one reduction over all their gradients (one device sync on CUDA).
    tail_grads = [engine._buffers[fl.bucket].params[i].grad
                  for fl in flights if fl.on_device for i in fl.members]
    tail = engine.backend.device_stats(tail_grads) if tail_grads else GradStats(0.0, 0)  # type: ignore[arg-type]
    sum_sq, nonfinite = tail.sum_sq, tail.nonfinite
    for fl in flights:
        if fl.on_device or fl.d2h is None:
            continue
        stats = engine._wait(fl.d2h, f"D2H of bucket {fl.bucket}")
        if stats.nonfinite:
            engine.stats.nonfinite_buckets += 1
        sum_sq += stats.sum_sq
        nonfinite += stats.nonfinite
    loss_scale = engine.scaler.loss_scale
    v = verdict(sum_sq, nonfinite, loss_scale=loss_scale, max_grad_norm=cfg.max_grad_norm)
    rec.add(LANE_COMPUTE, KIND_VALIDATE, t0, rec.now(), iteration=engine.iteration)

    for fl in flights:
        buf = engine._buffers[fl.bucket]
        if fl.on_device:
            if v.action is not Action.SKIP and fl.members:
                device_step(buf, fl.calls, grad_scale=v.grad_scale, recorder=rec,
                            iteration=engine.iteration)
            continue
        if fl.spec is not None and v.action is not Action.COMMIT:
            rollback = engine.worker.submit(RollbackTask(
                bucket=fl.bucket, iteration=engine.iteration, buffers=buf, calls=fl.calls,
                grad_scale=fl.spec_scale, threads=engine.threads, step_future=fl.spec,
                mode=cfg.rollback, recorder=rec, watchdog_s=cfg.watchdog_s,
            ))
            rollback.add_done_callback(_counter(engine, "rollbacks"))
            if v.action is Action.SKIP:
                _submit_h2d(engine, buf, fl.members, rollback)  # publish the restored weights
        if v.action is Action.SKIP or not fl.members:
            continue
        if fl.spec is None or v.action is Action.CLIP:
            replay = fl.spec is not None
            step = engine.worker.submit(_step_task(
                engine, fl, buf, scale=v.grad_scale, after=None, speculative=False, replay=replay))
            if replay:
                step.add_done_callback(_counter(engine, "replays"))
            _submit_h2d(engine, buf, fl.members, step)

    if v.action is not Action.SKIP:
        for fl in flights:
            for pos in fl.members:
                engine._steps[engine._buffers[fl.bucket].bucket.param_indices[pos]] += 1
    close_iteration(engine, v, loss_scale)


def close_iteration(engine: Any, v: Any, loss_scale: float, *,
                    overflow: str = "overflow: non-finite gradient, step skipped") -> None:
    """Book-keeping at the end of an iteration, shared by OffloadEngine and the ZeRO engine
    (superoffload.distributed.zero): loss scaler, counters, adaptive STV, telemetry scalars
    and notes. `loss_scale` is the scale this iteration ran with (before the update)."""
    it, rec, n = engine._it, engine.telemetry, engine.iteration
    skipped = v.action is Action.SKIP
    engine.scaler.update(skipped)
    if skipped:
        engine.stats.skipped_steps += 1
        rec.note(n, f"{overflow}; loss scale {loss_scale:g} -> {engine.scaler.loss_scale:g}")
    if v.action is Action.CLIP:
        engine.stats.clipped_steps += 1
    note = engine.adaptive.observe(v.action is Action.CLIP)
    if note:
        rec.note(n, note)
    engine.stats.speculation_enabled = engine.adaptive.enabled
    engine.stats.iterations += 1
    if it.losses:
        rec.scalar("loss", n, sum(it.losses) / len(it.losses))
    rec.scalar("grad_norm", n, v.grad_norm)
    rec.scalar("loss_scale", n, loss_scale)
    rec.scalar("ratio", n, engine.config.ratio)
    rec.scalar("speculating", n, 1.0 if it.speculate else 0.0)
    engine.iteration += 1
