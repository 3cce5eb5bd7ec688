"""Optimizer-step tasks on a bucket: step, and undo a speculative step (paper §4.3).

A bucket's members are grouped into ``KernelCall``s sharing one param group and one step
count, so one kernel launch covers each group (DESIGN.md §4). Hyperparameters are read in
the training thread when the task is built and frozen into it, so an LR scheduler's change
takes effect on the next step and never races with the worker.

Rollback (DESIGN.md §4): "inverse" applies the kernel's algebraic inverse with the same
gradient, scale and hyperparameters (exact to a few ulps where the rejected gradient does not
dwarf the moments' history); "snapshot" restores pre-step copies of p, m, v taken just before
the speculative step (bit-exact, 12 B/param); "auto" (the default) is the inverse checked against
its error bound: elements beyond it are kept exactly, buckets certain to be clipped or with
too many such elements are not speculated (runtime/auto_rollback.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from superoffload import kernels
from superoffload.kernels import AdamHyper
from superoffload.runtime.auto_rollback import AutoRollback, Rescue
from superoffload.runtime.engine_state import BucketBuffers
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Priority
from superoffload.runtime.state_overflow import StateOverflow, may_overflow, trial
from superoffload.runtime.transfers import wait_for
from superoffload.telemetry.events import (
    KIND_CPU_STEP,
    KIND_DEVICE_STEP,
    KIND_REPLAY,
    KIND_ROLLBACK,
    LANE_CPU,
    LANE_DEVICE_OPT,
)
from superoffload.telemetry.recorder import Recorder


@dataclass(frozen=True, slots=True)
class KernelCall:
    """Members (positions within the bucket) sharing a param group and a step count."""

    members: tuple[int, ...]
    step: int
    hyper: AdamHyper


def sr_seed(seed: int, bucket: int, step: int, call: int) -> int:
    """The stochastic-rounding stream of one kernel call (bf16 moments, docs/kernel.md):
    distinct per (seed, bucket, step, call) and the same for a step and its rollback."""
    return (seed * 0xD6E8FEB86659FD93 + bucket * 0x9E3779B97F4A7C15
            + step * 0xBF58476D1CE4E5B9 + call * 0x94D049BB133111EB) % 2**64


def run_calls(
    buffers: BucketBuffers,
    calls: tuple[KernelCall, ...],
    grads: list[torch.Tensor],
    *,
    grad_scale: float,
    threads: int | None,
    rollback: bool = False,
    seed: int = 0,
) -> None:
    """Run the kernel (or its inverse) over ``calls``; ``grads`` indexed by bucket position.

    On the CPU each call is prepared once (``kernels.prepare_adam``: tensors validated and
    the C descriptor built when first used, kept on the bucket's buffers, which never move;
    docs/kernel.md, "Prepared calls") and then only its numbers are checked per step. A host
    bucket's gradient buffers are part of the prepared call; the tail on the CPU device ops
    passes its ``.grad`` tensors per call (they are new every iteration)."""
    # an empty bucket has no tensor to ask: it takes the CPU path, which runs no call
    on_cpu = True
    if buffers.master:
        on_cpu = buffers.master[0].device.type == "cpu"
    if rollback and not on_cpu:
        raise RuntimeError("device buckets are never speculated, so never rolled back")
    # host buckets: the gradient buffers never move, so the prepared call holds them; the
    # tail passes its .grad tensors per call (new every iteration)
    fixed = grads is buffers.grad_host
    for k, call in enumerate(calls):
        idx = call.members
        lp: list[torch.Tensor] | None = None
        if buffers.lp_host is not None:
            lp = [buffers.lp_host[i] for i in idx]
        elif buffers.on_device:
            # a tail bucket of a bf16 model: its fp32 master is not the parameter itself, so
            # the step writes the parameter as the low-precision copy
            first = idx[0]
            if buffers.master[first].data_ptr() != buffers.params[first].data_ptr():
                lp = [buffers.params[i].data for i in idx]
        h = call.hyper
        # a GPU tail bucket: torch's fused Adam (kernels/device_adam.py)
        if not on_cpu:
            kernels.device_adam_multi(
                [buffers.master[i] for i in idx], [grads[i] for i in idx],
                [buffers.exp_avg[i] for i in idx], [buffers.exp_avg_sq[i] for i in idx],
                step=call.step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                weight_decay=h.weight_decay, adamw_mode=h.adamw_mode,
                bias_correction=h.bias_correction, grad_scale=grad_scale, params_lp=lp,
                maximize=h.maximize)
            continue
        key = (idx, fixed)
        prep = buffers.prepared.get(key)
        # first use, or a tensor was re-pointed (a tier slot, a re-plan): prepare again
        if prep is None or prep.stale() is not None:
            prep = buffers.prepared[key] = kernels.prepare_adam(
                [buffers.master[i] for i in idx],
                [grads[i] for i in idx] if fixed else None,
                [buffers.exp_avg[i] for i in idx], [buffers.exp_avg_sq[i] for i in idx],
                params_lp=lp)
        run = prep.rollback if rollback else prep.step
        # a seed per (bucket, step, call): the inverse replays the step's stochastic rounding
        run(h, step=call.step, grad_scale=grad_scale, threads=threads,
            sr_seed=sr_seed(seed, buffers.bucket.id, call.step, k),
            grads=None if fixed else [grads[i] for i in idx])


def make_calls(buffers: BucketBuffers, present: frozenset[int] | set[int],
               group_of: Mapping[int, int], steps: Sequence[int],
               hypers: Sequence[AdamHyper]) -> tuple[KernelCall, ...]:
    """KernelCalls over the positions of ``buffers`` whose parameter is in ``present``,
    grouped by (param group, next step count); ``hypers`` per param group, read now."""
    keyed: dict[tuple[int, int], list[int]] = defaultdict(list)
    for pos, index in enumerate(buffers.bucket.param_indices):
        if index in present:
            # the step count the kernel's bias correction uses is the one after this step
            keyed[(group_of[index], steps[index] + 1)].append(pos)
    # sorted: the calls' order fixes their seeds (sr_seed's k), the same from run to run
    return tuple(KernelCall(tuple(pos), step, hypers[g])
                 for (g, step), pos in sorted(keyed.items()))


def members_of(calls: tuple[KernelCall, ...]) -> list[int]:
    return [i for c in calls for i in c.members]


def priority(b: int, frozen: FrozenIteration) -> Priority:
    """Worker / H2D priority of bucket ``b``: earliest deadline first -- the next forward
    needs the highest offloaded bucket id (the first layers) first, while backward produced
    it last (DESIGN.md §6); ``step_order="fifo"`` keeps gradient-ready order."""
    order = b
    if frozen.config.step_order == "deadline":
        # the highest bucket id is needed first by the next forward
        order = -b
    # an earlier iteration's work always goes first, whatever its deadline
    return (float(frozen.number), float(order))


@dataclass(frozen=True, slots=True)
class StepTask:
    """Step a host bucket from its host gradient buffer.

    Speculative steps (``after`` = the bucket's D2H future, ``skip_nonfinite``) run before
    the global verdict and are skipped when the bucket's own gradient is non-finite:
    that bucket would only have to be undone, and the inverse cannot undo inf/nan.
    Returns True when the step ran.
    """

    bucket: int
    iteration: int
    buffers: BucketBuffers
    calls: tuple[KernelCall, ...]
    grad_scale: float
    threads: int | None
    after: Future[Any] | None
    skip_nonfinite: bool
    snapshot: bool
    replay: bool
    recorder: Recorder
    watchdog_s: float
    seed: int = 0
    """``OffloadConfig.seed``: the stochastic rounding of bf16 moments (``sr_seed``)."""
    auto_rollback: AutoRollback | None = None
    """``rollback="auto"``: what the speculative step keeps, or whether it declines."""
    undone: Future[Any] | None = None
    """A replay: the rollback it follows (False when the speculative step had not run, e.g.
    declined under "auto": then this is the bucket's first step, not a replay)."""

    def run(self) -> bool | Rescue | StateOverflow:
        """True when the step ran (a ``Rescue`` under ``rollback="auto"`` when elements beyond
        the inverse's bound were kept: truthy, handed to the rollback through this result); a
        falsy ``StateOverflow`` when it would have written a non-finite p, m or v and was not
        taken (runtime/state_overflow.py: validation counts the bucket as non-finite)."""
        buf = self.buffers
        rescue: Rescue | None = None
        if self.after is not None:
            stats = wait_for(self.after, self.watchdog_s, f"D2H of bucket {self.bucket}")
            # resolve: the copy landed (CUDA: its event too), the statistics are final
            stats = stats.resolve()
            # the inverse cannot undo inf/nan: a bucket that would only be undone is skipped
            if stats.nonfinite and self.skip_nonfinite:
                return False
            # the cheap bound first; a trial on copies only where the state could overflow
            if may_overflow(stats.sum_sq, self.grad_scale, [c.hyper for c in self.calls]):
                # never in a sane run; tried before anything is written, so nothing to undo
                bad = trial(buf, self.calls, buf.grad_host, grad_scale=self.grad_scale,
                            threads=self.threads,
                            seeds=[sr_seed(self.seed, buf.bucket.id, c.step, k)
                                   for k, c in enumerate(self.calls)])
                if bad:
                    return StateOverflow(bad)
            if self.auto_rollback is not None:
                kept = self.auto_rollback.protect(buf, self.calls, self.grad_scale, stats.sum_sq)
                # clipping is certain: settle steps it after the verdict
                if kept is False:
                    return False
                # the rollback restores the kept elements (handed over through the result)
                if isinstance(kept, Rescue):
                    rescue = kept
        with torch.no_grad():
            if self.snapshot:
                snap = buf.snapshot
                assert snap is not None, "snapshot buffers are allocated before speculating"
                n = len(buf.params)
                for i in members_of(self.calls):
                    snap[i].copy_(buf.master[i])
                    snap[n + i].copy_(buf.exp_avg[i])
                    snap[2 * n + i].copy_(buf.exp_avg_sq[i])
            # a replay whose speculative step never ran (declined) is the first step: it
            # shows as a plain CPU step on the timeline
            replay = self.replay and (self.undone is None or bool(self.undone.result()))
            kind = KIND_REPLAY if replay else KIND_CPU_STEP
            with self.recorder.span(
                LANE_CPU, kind, iteration=self.iteration, bucket=self.bucket,
                # 28 B/param moved: p, m, v read and written (24) plus the fp32 gradient read
                nbytes=28 * sum(buf.master[i].numel() for i in members_of(self.calls)),
            ):
                run_calls(buf, self.calls, buf.grad_host, grad_scale=self.grad_scale,
                          threads=self.threads, seed=self.seed)
        return rescue if rescue is not None else True


@dataclass(frozen=True, slots=True)
class RollbackTask:
    """Undo a speculative step of a host bucket (if it ran). Returns True when undone."""

    bucket: int
    iteration: int
    buffers: BucketBuffers
    calls: tuple[KernelCall, ...]
    grad_scale: float
    """The scale the speculative step used (inverse mode needs the same gradient)."""
    threads: int | None
    step_future: Future[Any]
    mode: str
    recorder: Recorder
    watchdog_s: float
    seed: int = 0
    """``OffloadConfig.seed``: the stochastic rounding of bf16 moments (``sr_seed``)."""

    def run(self) -> bool:
        what = f"CPU step of bucket {self.bucket}"
        stepped = wait_for(self.step_future, self.watchdog_s, what)
        # skipped (non-finite), declined ("auto") or not taken (state overflow): nothing to undo
        if not stepped:
            return False
        buf = self.buffers
        with torch.no_grad(), self.recorder.span(
            LANE_CPU, KIND_ROLLBACK, iteration=self.iteration, bucket=self.bucket
        ):
            if self.mode == "snapshot":
                snap = buf.snapshot
                assert snap is not None
                n = len(buf.params)
                for i in members_of(self.calls):
                    buf.master[i].copy_(snap[i])
                    buf.exp_avg[i].copy_(snap[n + i])
                    buf.exp_avg_sq[i].copy_(snap[2 * n + i])
                    # the host bf16 copy was written by the step too: restore it from master
                    if buf.lp_host is not None:
                        buf.lp_host[i].copy_(buf.master[i])
            else:
                run_calls(buf, self.calls, buf.grad_host, grad_scale=self.grad_scale,
                          threads=self.threads, rollback=True, seed=self.seed)
                # "auto": the elements beyond the inverse's bound come back from their copy
                if isinstance(stepped, Rescue):
                    stepped.restore()
        return True


def step_task(bucket: int, buffers: BucketBuffers, calls: tuple[KernelCall, ...],
              frozen: FrozenIteration, recorder: Recorder, *, scale: float,
              after: Future[Any] | None, speculative: bool, replay: bool,
              undone: Future[Any] | None = None, versioned: bool = False) -> StepTask:
    """The task stepping ``calls`` of bucket ``bucket`` with the iteration's settings: a
    speculative step (after its gradients' move ``after``; kept by "snapshot", checked by
    "auto"), a replay after the rollback ``undone``, or a bucket's only step. ``versioned``:
    a storage-tier bucket, undone by its versions (runtime/tier_steps.py), so neither
    "snapshot" nor "auto" keeps anything."""
    cfg = frozen.config
    # only a speculative step may be undone; a tier bucket is undone by its versions
    guard = speculative and not versioned
    auto_rollback = None
    if guard and cfg.rollback == "auto":
        auto_rollback = AutoRollback(cfg.max_grad_norm, frozen.threads)
    return StepTask(
        bucket=bucket, iteration=frozen.number, buffers=buffers, calls=calls, grad_scale=scale,
        threads=frozen.threads, after=after, skip_nonfinite=speculative,
        snapshot=guard and cfg.rollback == "snapshot", replay=replay, recorder=recorder,
        watchdog_s=cfg.watchdog_s, seed=cfg.seed,
        auto_rollback=auto_rollback, undone=undone)


def rollback_task(bucket: int, buffers: BucketBuffers, calls: tuple[KernelCall, ...],
                  frozen: FrozenIteration, recorder: Recorder, *, scale: float,
                  step_future: Future[Any]) -> RollbackTask:
    """The task undoing the speculative step ``step_future`` (with its ``scale``), if it ran."""
    cfg = frozen.config
    return RollbackTask(
        bucket=bucket, iteration=frozen.number, buffers=buffers, calls=calls, grad_scale=scale,
        threads=frozen.threads, step_future=step_future, mode=cfg.rollback, recorder=recorder,
        watchdog_s=cfg.watchdog_s, seed=cfg.seed)


def device_step(
    buffers: BucketBuffers,
    calls: tuple[KernelCall, ...],
    grads: Sequence[torch.Tensor],
    *,
    grad_scale: float,
    threads: int | None,
    recorder: Recorder,
    iteration: int,
) -> None:
    """Step a GPU tail bucket on the device with the final clip/unscale factor (§4.2);
    ``grads`` per position of ``buffers`` (the transport's: local, or all-reduced)."""
    # the kernels read fp32 or bf16 gradients; widen fp16 ones on the device
    grads = [g.float() if g.dtype == torch.float16 else g for g in grads]
    with torch.no_grad(), recorder.device_span(
        LANE_DEVICE_OPT, KIND_DEVICE_STEP, iteration=iteration, bucket=buffers.bucket.id,
        nbytes=28 * sum(buffers.master[i].numel() for i in members_of(calls)),
    ):
        run_calls(buffers, calls, list(grads), grad_scale=grad_scale, threads=threads)
