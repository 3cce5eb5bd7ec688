"""The single-process transport: D2H of a bucket's gradients, H2D of its new weights (§4.2).

A host bucket keeps its fp32 master, moments and a gradient buffer on the host (pinned on
CUDA); its gradients are copied device -> host on the ``d2h`` lane (the device ops compute the
bucket's local validation statistics on the way) and, after the CPU step, its weights host ->
device on the ``h2d`` lane: the bf16 copy the kernel wrote (host-side casting) or the fp32
master cast on the device (paper §4.4). A GPU tail bucket keeps everything on the device and
moves nothing. Under weight-flow the host copy each CPU step writes is the weights' home and
streamed weights are not copied back here (runtime/weightflow.py fetches them per block).

What it shares with the FSDP2 transport it holds, as that one does: the buckets' buffers and
their reads and writes outside a step (``BucketStore``, runtime/bucket_store.py) and the copy
lanes (``CopyLanes``, runtime/copy_lanes.py) over the model's own parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from superoffload.plan.buckets import BucketPlan
from superoffload.runtime.bucket_store import BucketStore
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.copy_lanes import CopyLanes
from superoffload.runtime.devices import GradStats
from superoffload.runtime.engine_state import BucketBuffers, ParamState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane, Priority
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transfers import transfer_hint
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
        self._copies: CopyLanes | None = None
        self.store = BucketStore()
        """The buckets' buffers, host memory or storage tier (runtime/bucket_store.py)."""

    @property
    def tier(self) -> StateTier | None:
        """The storage tier of the host buckets placed there (runtime/tier.py), or None."""
        return self.store.tier

    @property
    def ctx(self) -> TransportContext:
        if self._ctx is None:
            raise RuntimeError("LocalTransport.start() was not called")
        return self._ctx

    @property
    def copies(self) -> CopyLanes:
        """The d2h and h2d lanes (made by ``start``)."""
        if self._copies is None:
            raise RuntimeError("LocalTransport.start() was not called")
        return self._copies

    @property
    def lanes(self) -> tuple[Lane, ...]:
        own = self._copies.lanes if self._copies is not None else ()
        return own + self.store.lanes

    def start(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        # the model's parameters, their whole .grad
        self._copies = CopyLanes(ctx, self.store)

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
        return self.copies.launch(b, present, frozen, accumulated=accumulated, final=final)

    def full_grad(self, index: int) -> torch.Tensor | None:
        """The gradient of parameter ``index`` as the optimizer will read it (loss-scaled,
        summed over micro-steps): its host buffer for a host bucket (once its D2H landed; read
        back from the file for a storage-tier bucket), the device ``.grad`` for a tail bucket.
        None when it got no gradient."""
        buf, k = self.store.where(index)
        if buf.on_device:
            g = buf.params[k].grad
            return None if g is None else g.detach()
        return self.store.host_grad(buf, k)

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        return self.copies.tail_stats(buckets)

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        return self.copies.tail_grads(b)

    def discard(self, buckets: Sequence[int]) -> None:
        # a tail bucket moves nothing
        return None

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        return GlobalStats(local.sum_sq, local.nonfinite, present, edited=int(checks.edited))

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        # one process: nothing to compare
        return None

    def adopt(self, indices: Sequence[int]) -> None:
        self.store.adopt(indices)

    def restore(self, indices: Sequence[int]) -> list[int]:
        return self.store.restore(indices)

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Published:
        buf = self.store.buffers[b]
        # weight-flow: streamed weights are not on the device; their next fetch waits for the
        # step that wrote their home (runtime/weightflow.py); only resident ones are copied
        keep = tuple(k for k in positions if buf.bucket.param_indices[k] not in frozen.streamed)
        if not keep:
            return Published(None, after)
        fut = self.copies.publish(b, keep, after, frozen, priority)
        # a home to wait for only under weight-flow: a step's result (a rollback="auto"
        # Rescue: exact copies of guarded elements) must not outlive its iteration otherwise
        return Published(fut, after if frozen.streamed else None)

    def home(self, index: int) -> torch.Tensor:
        return self.store.home(*self.store.where(index))

    def stall_hint(self) -> str:
        lanes = self._copies.lanes if self._copies is not None else ()
        # blames the device only when a copy is running
        return transfer_hint(lanes)

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        return self.store.export(self.ctx.state.steps, tier=tier)

    def close(self) -> None:
        self.store.close()
        if self._copies is not None:
            self._copies.close()
