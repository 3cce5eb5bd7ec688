"""The offload engine's transport over FSDP2 (docs/distributed.md, "Data parallel over FSDP2").

FSDP2 (``fully_shard``) reduce-scatters each unit's gradients in backward and all-gathers its
weights before the unit's forward, so this transport issues no collective per bucket: it
moves this rank's local shards with the same parts as the single-process transport, held, not
inherited -- the buckets' buffers (``BucketStore``, runtime/bucket_store.py) and the copy
lanes (``CopyLanes``, runtime/copy_lanes.py), told to move the local shard of each gradient
(``local_shard``). FSDP2 calls a sharded parameter's post-accumulate-grad hooks once the
averaged shard is in ``.grad`` (torch 2.13 ``foreach_reduce``; ``grad_divisor`` = 1), so a
bucket launches when its units have reduced. The CPU step, STV, rollback and the GPU tail's
device step run on the local shards. Validation is one all-reduce over every rank (shards are
disjoint; under HSDP only the first replica adds its sum of squares), "present" meaning what
some rank used (``used``, filled by hooks.py). A ``publish`` writes the stepped master (or
bf16 copy) into the local shards FSDP2 all-gathers from, and each unit's pre-hook waits for it
(``wait_published``, called by hooks.py; this module calls no hook). Weight-flow is FSDP2's
own (flow.py): the engine streams nothing (``streamed`` is empty here). What FSDP2 needs of
the model (units, guarded collectives, hooks) the engine applies (fsdp_engine.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any
from typing import cast as typed

import torch
import torch.distributed as dist

from superoffload.distributed.budget import HostBudget, agree_host_budget, plan_host_bytes
from superoffload.distributed.process_group import stall_cause
from superoffload.distributed.validation import agree_fingerprint, all_reduce_validation
from superoffload.kernels.optimizer_batches import is_dtensor, local_shard, state_like
from superoffload.plan.buckets import Bucket, BucketPlan
from superoffload.runtime.bucket_store import BucketStore
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.copy_lanes import CopyLanes
from superoffload.runtime.devices import GradStats
from superoffload.runtime.engine_state import BucketBuffers, ParamState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane, Priority, describe_lane
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transport import (
    NO_CHECKS,
    Checks,
    GlobalStats,
    Published,
    TransportContext,
)


class FsdpTransport:
    """The engine's buckets over an FSDP2-sharded model (see the module docstring). ``used``:
    the parameters that got a gradient on this rank this optimizer step (hooks.py's
    ``UsageLog`` fills it); ``mesh``: the model's (2-D: HSDP); ``host_*``: the host memory
    check's inputs (budget.py)."""

    name = "fsdp"
    collective = True
    """Every rank steps together (FSDP2's collectives): an interrupted iteration fails the
    engine on every rank instead of rolling back on one."""
    ordered_launch = False
    """No collective per bucket: FSDP2 issued the reduce-scatters already."""
    grad_divisor = 1
    """FSDP2 averages the gradients over the ranks in its reduce-scatter."""
    accumulates_on_host = True

    def __init__(self, *, used: set[int], mesh: Any = None,
                 host_available_bytes: int | None = None,
                 host_headroom: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FsdpTransport: initialise torch.distributed first "
                               "(superoffload.distributed.init_distributed under torchrun)")
        self._ctx: TransportContext | None = None
        self._copies: CopyLanes | None = None
        self.store = BucketStore()
        """This rank's buckets: buffers of its local shards (runtime/bucket_store.py)."""
        self.used = used
        self.mesh = mesh
        self.group: Any = dist.group.WORLD
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank()
        self.world_size = len(self.ranks)
        self.local_ranks = 1
        self.first_replica = True
        """HSDP: this rank belongs to the first replica (its shards count in the norm)."""
        self.shard_ranks = self.world_size
        """Ranks one replica's shards are spread over (HSDP: world size / replicas)."""
        self.host_budget: HostBudget | None = None
        self._budget_args = (host_available_bytes, host_headroom)
        self.published: dict[int, Future[Any]] = {}
        """Bucket -> its last publish (what a unit's all-gather waits for)."""
        self.watchdog_s = 0.0
        """The watchdog of the iteration whose publishes are in flight."""

    @property
    def ctx(self) -> TransportContext:
        if self._ctx is None:
            raise RuntimeError("FsdpTransport.start() was not called")
        return self._ctx

    @property
    def copies(self) -> CopyLanes:
        """The d2h and h2d lanes over the local shards (made by ``start``)."""
        if self._copies is None:
            raise RuntimeError("FsdpTransport.start() was not called")
        return self._copies

    @property
    def tier(self) -> StateTier | None:
        return self.store.tier

    @property
    def lanes(self) -> tuple[Lane, ...]:
        own = self._copies.lanes if self._copies is not None else ()
        return own + self.store.lanes

    # ------------------------------------------------------------------ set-up
    def start(self, ctx: TransportContext) -> None:
        from superoffload.distributed.budget import count_local_ranks

        self._ctx = ctx
        # before any collective whose sizes depend on it
        if ctx.fingerprint is not None:
            self.agree(ctx.fingerprint)
        st = ctx.state
        plain = [st.names[i] for i in st.trainable if not is_dtensor(st.params[i])]
        if plain:
            raise ValueError(f"FsdpTransport: parameters {plain[:3]} are not FSDP2 shards; "
                             "call fully_shard on the model (and its blocks) before building "
                             "the engine, or build FsdpOffloadEngine, which shards it")
        if self.mesh is None:
            self.mesh = st.params[st.trainable[0]].device_mesh  # type: ignore[attr-defined]
        if self.mesh.ndim == 2:  # HSDP: (replicate, shard)
            self.first_replica = self.mesh.get_local_rank(0) == 0
        self.shard_ranks = self.mesh.size(self.mesh.ndim - 1)
        self.local_ranks = count_local_ranks(self.group)
        # this rank's shard moves
        self._copies = CopyLanes(ctx, self.store, local_shard)

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool, moments: torch.dtype = torch.float32,
              storage: Storage | None = None) -> list[BucketBuffers]:
        """Each rank allocates its local shard of every bucket from ``states`` (full tensors,
        or DTensors of the parameters' layout) and writes the masters into the shards (a
        load, a resharded resume)."""
        st = self.ctx.state
        local = {b.id: [typed(torch.nn.Parameter, local_shard(st.params[i]))
                        for i in b.param_indices] for b in plan.buckets}
        tier_plan = self.store.place(
            plan, {b.id: sum(p.numel() for p in local[b.id]) for b in plan.host_buckets}, cast,
            flow, snapshot, moments, storage)
        numels = [[p.numel() for p in local[b.id]] for b in plan.buckets if not b.on_device]
        # every rank agrees before allocating
        available, headroom = self._budget_args
        self.host_budget = plan_host_bytes(
            numels, dtype=st.model_dtype, snapshot=snapshot, moments=moments,
            local_ranks=self.local_ranks, available=available, headroom=headroom,
            planned=None if tier_plan is None else tier_plan.host_bytes)
        agree_host_budget(self.host_budget, self.group, self.rank)

        def states_of(bucket: Bucket) -> list[ParamState]:
            """This rank's shards of the bucket's states; the shards take the masters'
            values (a load, a resharded resume)."""
            states_here = [_local_state(states[i], st.params[i]) for i in bucket.param_indices]
            with torch.no_grad():
                for shard, state in zip(local[bucket.id], states_here):
                    shard.copy_(state.master)
            return states_here

        return self.store.build(self.ctx, plan, lambda b: local[b.id], states_of, cast,
                                flow=flow, moments=moments, tier_plan=tier_plan,
                                storage=storage, rank=self.rank)

    # ------------------------------------------------------------------ per iteration
    def launch(self, b: int, present: tuple[int, ...], frozen: FrozenIteration, *,
               accumulated: frozenset[int] | None = None,
               final: bool = True) -> Future[Any] | None:
        return self.copies.launch(b, present, frozen, accumulated=accumulated, final=final)

    def full_grad(self, index: int) -> torch.Tensor | None:
        """The gradient the optimizer reads, as a DTensor of the parameter's layout (this
        rank's host buffer as its local shard; ``.full_tensor()`` gathers it, collective)."""
        buf, k = self.store.where(index)
        p = self.ctx.state.params[index]
        if buf.on_device:
            g = p.grad
            return None if g is None else g.detach()
        return _as_dtensor(self.store.host_grad(buf, k).to(p.device), p)

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        stats = self.copies.tail_stats(buckets)
        # HSDP: the replicas hold the same shards, so only the first one's squares count in
        # the world's sum; a non-finite value counts from any of them
        if not self.first_replica:
            return GradStats(0.0, stats.nonfinite)
        return stats

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        return self.copies.tail_grads(b)

    def discard(self, buckets: Sequence[int]) -> None:
        # a tail bucket moves nothing; FSDP2 reduced it already
        return None

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        """One all-reduce of the validation vector over every rank; "present" is what this
        rank used (FSDP2 reduced zeros for the rest)."""
        used = present & frozenset(self.used)
        if not self.first_replica:
            local = GradStats(0.0, local.nonfinite)
        return all_reduce_validation(local, used, checks, self.ctx.state.trainable,
                                     self.group, self.world_size, "all_reduce (validation)")

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        """Every rank built the same model, configuration and param groups (or all raise)."""
        agree_fingerprint(fingerprint, self.group, self.ranks)

    def adopt(self, indices: Sequence[int]) -> None:
        # into this rank's shards of the masters
        self.store.adopt(indices)

    def restore(self, indices: Sequence[int]) -> list[int]:
        # into this rank's shards of the weights
        return self.store.restore(indices)

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Published:
        # FSDP2's shards are the weights' only home: always written (weight-flow included:
        # nothing is streamed by the engine), the whole bucket: a parameter some rank stepped
        # speculatively and no rank used is rolled back, and its restored value must land too
        # (settle replays only the used)
        every = tuple(range(len(self.store.buffers[b].params)))
        self.watchdog_s = frozen.config.watchdog_s
        self.published[b] = fut = self.copies.publish(b, every, after, frozen, priority)
        # no engine-streamed home to wait for
        return Published(fut, None)

    def wait_published(self, indices: Sequence[int]) -> list[Any]:
        """Before FSDP2 all-gathers a unit (hooks.py): the last publish of every bucket
        holding parameters ``indices`` has landed, waited through the engine's waits (a
        lane's failure surfaces as the engine's error); their results (CUDA: H2D events)."""
        bucket_of, waits = self.store.bucket_of, self.ctx.in_flight
        # a frozen parameter has no bucket, so no publish to wait for
        buckets = sorted({bucket_of[i] for i in indices if i in bucket_of})
        return [waits.wait(f, "publish before FSDP2's all-gather", self.watchdog_s)
                for b in buckets if (f := self.published.get(b)) is not None]

    def home(self, index: int) -> torch.Tensor:
        raise RuntimeError("FsdpTransport: weight-flow is FSDP2's (flow.py); the engine "
                           "streams no block itself")

    def stall_hint(self) -> str:
        lanes = ", ".join(describe_lane(lane) for lane in
                          (self._copies.lanes if self._copies is not None else ()))
        return (f"transfer lanes: {lanes}; FSDP2's collectives run in backward and in its "
                f"forward pre-hooks, over ranks {self.ranks}: {stall_cause(self.ranks)}")

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        """Every trainable parameter's state as DTensors of its layout (CPU local shards):
        no communication; ``build`` takes them back (a re-plan), DCP saves them."""
        params = self.ctx.state.params
        out: dict[int, ParamState] = {}
        for i, s in self.store.export(self.ctx.state.steps, tier=tier).items():
            master, exp_avg, exp_avg_sq = (_as_dtensor(t, params[i])
                                           for t in (s.master, s.exp_avg, s.exp_avg_sq))
            out[i] = ParamState(master, exp_avg, exp_avg_sq, s.step)
        return out

    def close(self) -> None:
        self.published.clear()
        self.store.close()
        if self._copies is not None:
            self._copies.close()


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor whose local shard is on the CPU (``export_states``):
    gathered on the mesh's device (NCCL gathers device tensors), returned on the CPU."""
    # a DTensor (typed Any: FSDP2's shard tensors)
    dt: Any = t
    if dt.device_mesh.device_type != "cpu":
        dt = _as_dtensor(dt.to_local().to(dt.device_mesh.device_type), dt)
    return dt.full_tensor().cpu()  # type: ignore[no-any-return]


def _as_dtensor(local: torch.Tensor, p: Any) -> torch.Tensor:
    """``local`` as this rank's shard of a DTensor laid out as parameter ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _local_state(state: ParamState, p: torch.Tensor) -> ParamState:
    """This rank's shard of a parameter's state (a DTensor, or a full tensor from a load)."""
    master, exp_avg, exp_avg_sq = (local_shard(state_like(t, p, torch.float32))
                                   for t in (state.master, state.exp_avg, state.exp_avg_sq))
    return ParamState(master, exp_avg, exp_avg_sq, state.step)
