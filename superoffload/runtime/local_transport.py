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
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.devices import GradStats
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane, Priority, make_lane
from superoffload.runtime.state import (
    BucketBuffers,
    ParamState,
    adopt_value,
    build_buffers,
    export_state,
)
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
        self.buffers: list[BucketBuffers] = []
        self._pos: dict[int, int] = {}

    @property
    def ctx(self) -> TransportContext:
        if self._ctx is None:
            raise RuntimeError(f"{type(self).__name__}.start() was not called")
        return self._ctx

    @property
    def lanes(self) -> tuple[Lane, ...]:
        return self._lanes

    def start(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        self._lanes = tuple(make_lane(n, inline=ctx.inline, on_error=ctx.on_error)
                            for n in ("d2h", "h2d"))

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool,
              moments: torch.dtype = torch.float32) -> list[BucketBuffers]:
        st, be = self.ctx.state, self.ctx.device_ops
        self.buffers, self._pos = [], {}
        for bucket in plan.buckets:
            params = [st.params[i] for i in bucket.param_indices]
            self.buffers.append(build_buffers(
                bucket, params, [states[i] for i in bucket.param_indices],
                alloc_host=be.alloc_host, alloc_device=be.alloc_device,
                grad_host_dtype=cast.grad_host_dtype,
                lp_host=cast.low_precision and cast.param_on_host, moment_dtype=moments))
            self._pos.update((i, pos) for pos, i in enumerate(bucket.param_indices))
        return self.buffers

    def launch(self, b: int, present: tuple[int, ...], frozen: FrozenIteration, *,
               accumulated: frozenset[int] | None = None,
               final: bool = True) -> Future[Any] | None:
        buf = self.buffers[b]
        if buf.on_device or not (present or accumulated):
            return None
        ctx = self.ctx
        grads = tuple(self.device_grad(i) for i in present)
        views = tuple(buf.grad_host[self._pos[i]] for i in present)
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
                stats_host=tuple(buf.grad_host[self._pos[i]] for i in summed),
                want_stats=final)
        return self._lanes[0].submit(task)

    def device_grad(self, index: int) -> torch.Tensor | None:
        """The device gradient of parameter ``index`` as this transport moves it."""
        return self.ctx.state.params[index].grad

    def full_grad(self, index: int) -> torch.Tensor | None:
        """The gradient of parameter ``index`` as the optimizer will read it (loss-scaled,
        summed over micro-steps): its host buffer for a host bucket (once its D2H landed),
        the device ``.grad`` for a tail bucket. None when it got no gradient."""
        buf, k = self._where(index)
        if buf.on_device:
            g = buf.params[k].grad
            return None if g is None else g.detach()
        return buf.grad_host[k]

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
        return self.buffers[self.ctx.state.bucket_of[index]], self._pos[index]

    def adopt(self, indices: Sequence[int]) -> None:
        params = self.ctx.state.params
        for i in indices:
            buf, k = self._where(i)
            if buf.master[k].data_ptr() != params[i].data_ptr():  # fp32 tail: p is the master
                adopt_value(buf.master[k], params[i], None if buf.lp_host is None else buf.lp_host[k])

    def restore(self, indices: Sequence[int]) -> list[int]:
        params, lost = self.ctx.state.params, []
        with torch.no_grad():
            for i in indices:
                buf, k = self._where(i)
                src = buf.lp_host if buf.lp_host is not None else buf.master
                if src[k].data_ptr() != params[i].data_ptr():
                    params[i].data.copy_(src[k])
                else:
                    lost.append(i)  # an fp32 tail parameter is its own master
        self.ctx.device_ops.synchronize()
        return lost

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
        return Published(fut, after)

    def home(self, index: int) -> torch.Tensor:
        st = self.ctx.state
        buf = self.buffers[st.bucket_of[index]]
        pos = self._pos[index]
        return buf.lp_host[pos] if buf.lp_host is not None else buf.master[pos]

    def stall_hint(self) -> str:
        return transfer_hint(self._lanes)  # blames the device only when a copy is running

    def export_states(self) -> dict[int, ParamState]:
        steps = self.ctx.state.steps
        out: dict[int, ParamState] = {}
        for buf in self.buffers:
            idx = buf.bucket.param_indices
            out.update(zip(idx, export_state(buf, [steps[i] for i in idx])))
        return out

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()
        self.buffers = []
