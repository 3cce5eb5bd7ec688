"""The single-process transport: D2H of a bucket's gradients, H2D of its new weights (§4.2).

A host bucket keeps its fp32 master, moments and a gradient buffer on the host (pinned on
CUDA); its gradients are copied device -> host on the ``d2h`` lane (the device ops compute the
bucket's local validation statistics on the way) and, after the CPU step, its weights host ->
device on the ``h2d`` lane: the bf16 copy the kernel wrote (host-side casting) or the fp32
master cast on the device (paper §4.4). A GPU tail bucket keeps everything on the device and
moves nothing. Under weight-flow the host copy each CPU step writes is the weights' home and
streamed weights are not copied back here (runtime/weightflow.py fetches them per block).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from superoffload.plan.buckets import BucketPlan
from superoffload.runtime.bucket_store import BucketStore
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.devices import GradStats
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane, Priority, make_lane
from superoffload.runtime.state import BucketBuffers, ParamState
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transfers import D2HTask, H2DTask, transfer_hint
from superoffload.runtime.transport import (
    NO_CHECKS,
    Checks,
    GlobalStats,
    Published,
    TransportContext,
)


class LocalTransport:
    """Gradients and weights between one device and its host (see the module docstring)."""

    name = "local"
    collective = False
    ordered_launch = False
    accumulates_on_host = True
    grad_divisor = 1
    rank = 0
    local_ranks = 1

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._lanes: tuple[Lane, ...] = ()
        self.store = BucketStore()
        """The buckets' buffers, host memory or storage tier (runtime/bucket_store.py)."""

    @property
    def buffers(self) -> list[BucketBuffers]:
        return self.store.buffers

    @property
    def tier(self) -> StateTier | None:
        """The storage tier of the host buckets placed there (runtime/tier.py), or None."""
        return self.store.tier

    @property
    def ctx(self) -> TransportContext:
        if self._ctx is None:
            raise RuntimeError(f"{type(self).__name__}.start() was not called")
        return self._ctx

    @property
    def lanes(self) -> tuple[Lane, ...]:
        return self._lanes + self.store.lanes

    def start(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        self._lanes = tuple(make_lane(n, inline=ctx.inline, on_error=ctx.on_error)
                            for n in ("d2h", "h2d"))

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool, moments: torch.dtype = torch.float32,
              storage: Storage | None = None) -> list[BucketBuffers]:
        st = self.ctx.state
        tier_plan = self.store.place(plan, {b.id: b.numel for b in plan.host_buckets}, cast,
                                     flow, snapshot, moments, storage)
        return self.store.build(
            self.ctx, plan, lambda b: [st.params[i] for i in b.param_indices],
            lambda b: [states[i] for i in b.param_indices], cast, flow=flow, moments=moments,
            tier_plan=tier_plan, storage=storage, rank=self.rank)

    def launch(self, b: int, present: tuple[int, ...], frozen: FrozenIteration, *,
               accumulated: frozenset[int] | None = None,
               final: bool = True) -> Future[Any] | None:
        buf = self.buffers[b]
        if buf.on_device or not (present or accumulated):
            return None
        ctx = self.ctx
        grads = tuple(self.device_grad(i) for i in present)
        views = tuple(buf.grad_host[self.store.pos[i]] for i in present)
        if accumulated is None:  # one D2H per optimizer step: the final gradients
            task = D2HTask(bucket=b, iteration=frozen.number, grads=grads,  # type: ignore[arg-type]
                           grad_host=views, ready=ctx.device_ops.ready_token(),
                           device_ops=ctx.device_ops, recorder=ctx.recorder)
        else:  # host accumulation: this micro-step's gradients join the fp32 host sums
            summed = sorted(set(present) | accumulated)
            task = D2HTask(
                bucket=b, iteration=frozen.number, grads=grads,  # type: ignore[arg-type]
                grad_host=views, ready=ctx.device_ops.ready_token(), device_ops=ctx.device_ops,
                recorder=ctx.recorder, add=tuple(i in accumulated for i in present),
                stats_host=tuple(buf.grad_host[self.store.pos[i]] for i in summed),
                want_stats=final)
        return self._lanes[0].submit(task)

    def device_grad(self, index: int) -> torch.Tensor | None:
        """The device gradient of parameter ``index`` as this transport moves it."""
        return self.ctx.state.params[index].grad

    def full_grad(self, index: int) -> torch.Tensor | None:
        """The gradient of parameter ``index`` as the optimizer will read it (loss-scaled,
        summed over micro-steps): its host buffer for a host bucket (once its D2H landed; read
        back from the file for a storage-tier bucket), the device ``.grad`` for a tail bucket.
        None when it got no gradient."""
        buf, k = self._where(index)
        if buf.on_device:
            g = buf.params[k].grad
            return None if g is None else g.detach()
        return self.store.host_grad(buf, k)

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        grads = [p.grad for b in buckets for p in self.buffers[b].params if p.grad is not None]
        if not grads:
            return GradStats(0.0, 0)
        return self.ctx.device_ops.device_stats(grads)  # one reduction: one device sync on CUDA

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p)
                for p in self.buffers[b].params]

    def discard(self, buckets: Sequence[int]) -> None:
        return None  # a tail bucket moves nothing

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        return GlobalStats(local.sum_sq, local.nonfinite, present, edited=int(checks.edited))

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        return None  # one process: nothing to compare

    def _where(self, index: int) -> tuple[BucketBuffers, int]:
        return self.buffers[self.ctx.state.bucket_of[index]], self.store.pos[index]

    def adopt(self, indices: Sequence[int]) -> None:
        self.store.adopt(self._by_bucket(indices))

    def restore(self, indices: Sequence[int]) -> list[int]:
        lost = self.store.restore(self._by_bucket(indices))
        self.ctx.device_ops.synchronize()
        return [self.buffers[b].bucket.param_indices[k] for b, k in lost]

    def _by_bucket(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """Positions of ``indices`` in their buckets, per bucket."""
        out: dict[int, list[int]] = {}
        bucket_of = self.ctx.state.bucket_of
        for i in indices:
            out.setdefault(bucket_of[i], []).append(self.store.pos[i])
        return out

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Published:
        buf = self.buffers[b]
        # weight-flow: streamed weights are not on the device; their next fetch waits for the
        # step that wrote their home (runtime/weightflow.py); only resident ones are copied
        keep = tuple(k for k in positions if buf.bucket.param_indices[k] not in frozen.streamed)
        if not keep:
            return Published(None, after)
        src = buf.lp_host if buf.lp_host is not None else buf.master
        ctx = self.ctx
        fut = self._lanes[1].submit(H2DTask(
            bucket=b, iteration=frozen.number, src_host=tuple(src[k] for k in keep),
            dst_device=tuple(buf.params[k].data for k in keep), after=after,
            device_ops=ctx.device_ops, recorder=ctx.recorder, watchdog_s=frozen.config.watchdog_s),
            after=(after,), priority=priority)  # issued as soon as its step ends, by deadline
        # a home to wait for only under weight-flow: a step's result (a rollback="auto"
        # Rescue: exact copies of guarded elements) must not outlive its iteration otherwise
        return Published(fut, after if frozen.streamed else None)

    def home(self, index: int) -> torch.Tensor:
        buf, k = self._where(index)
        return self.store.home(buf, k)

    def stall_hint(self) -> str:
        return transfer_hint(self._lanes)  # blames the device only when a copy is running

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        out: dict[int, ParamState] = {}
        for b, states in self.store.export(self.ctx.state.steps, tier=tier).items():
            out.update(zip(self.buffers[b].bucket.param_indices, states))
        return out

    def close(self) -> None:
        self.store.close()
        for lane in self._lanes:
            lane.close()
