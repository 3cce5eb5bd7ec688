"""The copy lanes every transport holds: a bucket's gradients leave (D2H), its weights return
(H2D), and the device gradients a transport reads (paper §4.2; DESIGN.md §3 step 2).

Both transports move a bucket the same way once they know which tensors: one process moves
the model's parameters and their ``.grad``, FSDP2 this rank's local shards of them
(distributed/fsdp/fsdp_transport.py). So the ``d2h`` and ``h2d`` lanes, the tasks they run
(runtime/transfers.py) and the reads of a bucket's device gradients are written once, here,
over the buffers of the transport's ``BucketStore`` (runtime/bucket_store.py), and each
transport holds one ``CopyLanes`` (composition: as torchtitan keeps FSDP2 at the edge, the
step's code is the same whichever transport runs it). What differs is data, given here:

* ``grad_view``: the part of a parameter's ``.grad`` this rank moves (``whole``; FSDP2: the
  local shard of the DTensor gradient, ``kernels/optimizer_batches.py`` ``local_shard``);
* what a publish writes: the positions each transport passes (one process leaves
  weight-flow's streamed weights at home; FSDP2 writes every shard) into the buffers'
  ``params`` (the model's parameters, or the local shards FSDP2 all-gathers from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from superoffload.runtime.bucket_store import BucketStore
from superoffload.runtime.devices import GradStats
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane, Priority, make_lane
from superoffload.runtime.transfers import D2HTask, H2DTask
from superoffload.runtime.transport import TransportContext

GradView = Callable[[torch.Tensor], torch.Tensor]
"""A parameter's device gradient -> the tensor this rank moves and steps with."""


def whole(grad: torch.Tensor) -> torch.Tensor:
    """One process moves the whole gradient."""
    return grad


class CopyLanes:
    """A transport's ``d2h`` and ``h2d`` lanes over ``store``'s buckets (see the module
    docstring). ``ctx``: the transport's context (state, device ops, recorder, errors)."""

    def __init__(self, ctx: TransportContext, store: BucketStore,
                 grad_view: GradView = whole) -> None:
        self.ctx, self.store, self.grad_view = ctx, store, grad_view
        self.d2h, self.h2d = (make_lane(n, inline=ctx.inline, on_error=ctx.on_error)
                              for n in ("d2h", "h2d"))

    @property
    def lanes(self) -> tuple[Lane, Lane]:
        return self.d2h, self.h2d

    # ------------------------------------------------------------------ gradients leave
    def launch(self, b: int, present: tuple[int, ...], frozen: FrozenIteration, *,
               accumulated: frozenset[int] | None = None,
               final: bool = True) -> Future[Any] | None:
        """``Transport.launch`` (runtime/transport.py): bucket ``b``'s device gradients of
        ``present`` leave on the d2h lane; its local statistics come back as the future."""
        buf = self.store.buffers[b]
        if buf.on_device or not (present or accumulated):
            # a tail bucket steps where it is; nothing moves
            return None
        ctx, params, pos = self.ctx, self.ctx.state.params, self.store.pos
        # departures.py calls this only with parameters holding a gradient (``moving``)
        grads = tuple(self.grad_view(params[i].grad) for i in present)  # type: ignore[arg-type]
        views = tuple(buf.grad_host[pos[i]] for i in present)
        # one D2H per optimizer step: the final gradients
        if accumulated is None:
            task = D2HTask(bucket=b, iteration=frozen.number, grads=grads, grad_host=views,
                           ready=ctx.device_ops.ready_token(), device_ops=ctx.device_ops,
                           recorder=ctx.recorder)
        else:  # host accumulation: this micro-step's gradients join the fp32 host sums
            summed = sorted(set(present) | accumulated)
            task = D2HTask(
                bucket=b, iteration=frozen.number, grads=grads, grad_host=views,
                ready=ctx.device_ops.ready_token(), device_ops=ctx.device_ops,
                recorder=ctx.recorder, add=tuple(i in accumulated for i in present),
                stats_host=tuple(buf.grad_host[pos[i]] for i in summed), want_stats=final)
        return self.d2h.submit(task)

    # ------------------------------------------------------------------ weights return
    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Future[Any]:
        """After ``after`` (a step or rollback of bucket ``b``), copy the weights at
        ``positions`` (the bf16 copy the kernel wrote, or the fp32 master) into the buffers'
        ``params`` on the h2d lane; the future's result is the copy's device event, if any."""
        buf, ctx = self.store.buffers[b], self.ctx
        src = buf.lp_host if buf.lp_host is not None else buf.master
        return self.h2d.submit(H2DTask(
            bucket=b, iteration=frozen.number, src_host=tuple(src[k] for k in positions),
            dst_device=tuple(buf.params[k].data for k in positions), after=after,
            device_ops=ctx.device_ops, recorder=ctx.recorder, watchdog_s=frozen.config.watchdog_s),
            after=(after,), priority=priority)  # issued as soon as its step ends, by deadline

    # ------------------------------------------------------------------ the tail's gradients
    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        """Statistics of the tail buckets' device gradients (this rank's part)."""
        params = self.ctx.state.params
        grads = [self.grad_view(g) for b in buckets
                 for i in self.store.buffers[b].bucket.param_indices
                 if (g := params[i].grad) is not None]
        if not grads:
            return GradStats(0.0, 0)
        # one reduction: one device sync on CUDA
        return self.ctx.device_ops.device_stats(grads)

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        """The gradient tail bucket ``b`` steps with, per position (zeros where none)."""
        buf, params = self.store.buffers[b], self.ctx.state.params
        return [self.grad_view(g) if (g := params[i].grad) is not None else torch.zeros_like(p)
                for i, p in zip(buf.bucket.param_indices, buf.params)]

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
