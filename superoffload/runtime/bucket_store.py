"""One rank's bucket buffers and where each lives: on the device (GPU tail), in host memory,
or on the storage tier (runtime/tier.py); and the reads and writes of them outside a step.

Both transports build their buckets here from the parameters they step -- the model's own
(one process) or their local shards (FSDP2) -- and the per-parameter states, so the rule for
where a bucket's state lives (plan/storage.py), the tier's file and pool, and the reads of a
gradient, an adopted weight, a restore and an export are one code path whatever moves the
data (composition, as torchtitan keeps FSDP2 at the edge).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from superoffload.plan.buckets import Bucket, BucketPlan
from superoffload.plan.storage import TierPlan
from superoffload.runtime import tier_access
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.engine_state import (
    BucketBuffers,
    ParamState,
    adopt_value,
    build_buffers,
    export_state,
    unallocated_buffers,
)
from superoffload.runtime.lanes import Lane, make_lane
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_open import Storage, element_bytes, homes_of, open_tier, place
from superoffload.runtime.transport import TransportContext


class BucketStore:
    """Every bucket's buffers of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.buffers: list[BucketBuffers] = []
        self.pos: dict[int, int] = {}
        """Parameter index -> its position in its bucket."""
        self.bucket_of: dict[int, int] = {}
        """Parameter index -> its bucket (the plan's, as ``EngineState.bucket_of``)."""
        self.synchronize: Callable[[], None] = _nothing
        """The device ops' ``synchronize`` (set by ``build``): a restore has landed."""
        self.tier: StateTier | None = None
        """The storage tier of the host buckets placed there, or None."""
        self.tier_plan: TierPlan | None = None
        self.lanes: tuple[Lane, ...] = ()
        """The tier's read and write lanes, made with its first bucket."""

    def place(self, plan: BucketPlan, local_numel: Mapping[int, int], cast: CastPolicy,
              flow: bool, snapshot: bool, moments: torch.dtype,
              storage: Storage | None) -> TierPlan | None:
        """Which offloaded buckets live on the tier (the rule book, plan/storage.py), with this
        rank's elements per bucket; None without a tier or a budget."""
        if storage is None:
            return None
        return place(plan, local_numel, storage,
                     element_bytes(cast, moments, snapshot=snapshot, flow=flow),
                     homes_of(storage, cast, flow))

    def build(self, ctx: TransportContext, plan: BucketPlan,
              params_of: Callable[[Bucket], list[torch.nn.Parameter]],
              states_of: Callable[[Bucket], list[ParamState]], cast: CastPolicy, *,
              flow: bool, moments: torch.dtype, tier_plan: TierPlan | None,
              storage: Storage | None, rank: int) -> list[BucketBuffers]:
        """Allocate every bucket of ``plan``: ``params_of`` gives the parameters stepped (the
        model's, or local shards), ``states_of`` their placement-free states (read bucket by
        bucket, so a state larger than memory streams into the tier)."""
        be, lp = ctx.device_ops, cast.low_precision and cast.param_on_host
        on_tier: frozenset[int] = frozenset()
        if tier_plan is not None:
            on_tier = frozenset(tier_plan.tier)
        buffers: list[BucketBuffers] = []
        pos: dict[int, int] = {}
        local: dict[int, Bucket] = {}
        for bucket in plan.buckets:
            params = params_of(bucket)
            # this rank's elements, from the states or the tier's rule (not the parameters:
            # a weight-flow parameter between uses holds none)
            # its memory is a pool slot while it is worked on
            if bucket.id in on_tier:
                assert tier_plan is not None
                local[bucket.id] = Bucket(bucket.id, bucket.param_indices,
                                          tier_plan.region_of(bucket.id).numel, False)
                buffers.append(unallocated_buffers(local[bucket.id], params, lp_host=lp))
                continue
            states = states_of(bucket)
            local[bucket.id] = Bucket(bucket.id, bucket.param_indices,
                                      sum(s.master.numel() for s in states), bucket.on_device)
            buffers.append(build_buffers(
                local[bucket.id], params, states, alloc_host=be.alloc_host,
                alloc_device=be.alloc_device, grad_host_dtype=cast.grad_host_dtype,
                lp_host=lp, moment_dtype=moments))
        bucket_of: dict[int, int] = {}
        for bucket in plan.buckets:
            pos.update((i, k) for k, i in enumerate(bucket.param_indices))
            bucket_of.update((i, bucket.id) for i in bucket.param_indices)
        tier = None
        # written from the states, which may read the tier being replaced
        if on_tier:
            assert tier_plan is not None and storage is not None
            by_id = {b.id: b for b in plan.buckets}
            tier = open_tier(tier_plan, buffers, lambda b: states_of(by_id[b]),
                             storage=storage, cast=cast, moments=moments, flow=flow,
                             alloc_host=be.alloc_host, pinned=(be.alloc_pinned, be.free_pinned),
                             lanes=self._tier_lanes(ctx),
                             landed=be.host_wait, recorder=ctx.recorder, rank=rank,
                             track=ctx.in_flight.add,
                             raise_failed=ctx.in_flight.failures.raise_if_failed)
        old, self.tier, self.tier_plan = self.tier, tier, tier_plan
        if old is not None:
            old.close()
        self.buffers, self.pos, self.bucket_of = buffers, pos, bucket_of
        self.synchronize = be.synchronize
        return buffers

    def _tier_lanes(self, ctx: TransportContext) -> tuple[Lane, Lane]:
        if not self.lanes:
            self.lanes = tuple(make_lane(n, inline=ctx.inline, on_error=ctx.on_error)
                               for n in ("storage_read", "storage_write"))
        read, write = self.lanes
        return read, write

    def on_tier(self, b: int) -> bool:
        return self.tier is not None and self.tier.holds(b)

    def where(self, index: int) -> tuple[BucketBuffers, int]:
        """Parameter ``index``'s bucket buffers and its position there."""
        return self.buffers[self.bucket_of[index]], self.pos[index]

    def by_bucket(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """Positions of parameters ``indices`` in their buckets, per bucket."""
        out: dict[int, list[int]] = {}
        for i in indices:
            out.setdefault(self.bucket_of[i], []).append(self.pos[i])
        return out

    # ------------------------------------------------------------------ outside a step
    def host_grad(self, buf: BucketBuffers, k: int) -> torch.Tensor:
        """Position ``k`` of host bucket ``buf``'s gradient as the optimizer reads it: its
        host buffer, or read back from the tier's file."""
        if self.tier is not None and self.tier.holds(buf.bucket.id):
            return tier_access.read_grad(self.tier, buf.bucket.id, k)
        return buf.grad_host[k]

    def adopt(self, indices: Sequence[int]) -> None:
        """Parameters ``indices`` were written outside the engine: their fp32 masters (and
        host low-precision copies) take the written values, the moments stay (torch's
        semantics); on the tier, as the bucket's new version in force."""
        for b, positions in sorted(self.by_bucket(indices).items()):
            if self.tier is not None and self.tier.holds(b):
                with tier_access.loaded(self.tier, b, write=True) as buf:
                    _adopt(buf, positions)
            else:
                _adopt(self.buffers[b], positions)

    def restore(self, indices: Sequence[int]) -> list[int]:
        """Write the engine's weights back over parameters ``indices``, synchronously (a
        discarded racing write); returns those it could not restore (an fp32 tail parameter
        is its own master: a write to it leaves nothing to restore from)."""
        lost = []
        with torch.no_grad():
            for b, positions in sorted(self.by_bucket(indices).items()):
                if self.tier is not None and self.tier.holds(b):
                    with tier_access.loaded(self.tier, b, write=False, cast_lp=True) as buf:
                        src = buf.lp_host if buf.lp_host is not None else buf.master
                        for k in positions:
                            buf.params[k].data.copy_(src[k])
                    continue
                buf = self.buffers[b]
                src = buf.lp_host if buf.lp_host is not None else buf.master
                for k in positions:
                    if src[k].data_ptr() != buf.params[k].data_ptr():
                        buf.params[k].data.copy_(src[k])
                    else:
                        lost.append(buf.bucket.param_indices[k])
        # the copies have landed before the caller reads the weights
        self.synchronize()
        return lost

    def export(self, steps: Sequence[int], *, tier: bool) -> dict[int, ParamState]:
        """Placement-free copies (CPU, fp32) of every parameter's state, by parameter index
        (the tier's when ``tier``: read back through a slot, bucket by bucket)."""
        out: dict[int, ParamState] = {}
        for buf in self.buffers:
            b, idx = buf.bucket.id, buf.bucket.param_indices
            if self.tier is not None and self.tier.holds(b):
                if tier:
                    out.update(zip(idx, tier_access.export(self.tier, b,
                                                           [steps[i] for i in idx])))
                continue
            out.update(zip(idx, export_state(buf, [steps[i] for i in idx])))
        return out

    def home(self, buf: BucketBuffers, k: int) -> torch.Tensor:
        """Weight-flow: the host tensor position ``k`` of ``buf`` streams from."""
        return buf.lp_host[k] if buf.lp_host is not None else buf.master[k]

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        for lane in self.lanes:
            lane.close()
        self.buffers = []


def _nothing() -> None:
    return None


def _adopt(buf: BucketBuffers, positions: Sequence[int]) -> None:
    for k in positions:
        # fp32 tail: p is the master
        if buf.master[k].data_ptr() != buf.params[k].data_ptr():
            adopt_value(buf.master[k], buf.params[k],
                        None if buf.lp_host is None else buf.lp_host[k])
