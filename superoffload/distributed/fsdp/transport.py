"""The offload engine's transport over FSDP2 (docs/distributed.md, "Data parallel over FSDP2").

FSDP2 (``fully_shard``) reduce-scatters each unit's gradients in backward and all-gathers its
weights before the unit's forward, so this transport issues no collective per bucket: it is
the single-process transport (``LocalTransport``: D2H/H2D lanes, tasks, buffers) over this
rank's local shards. FSDP2 calls a sharded parameter's post-accumulate-grad hooks once the
averaged shard is in ``.grad`` (torch 2.13 ``foreach_reduce``; ``grad_divisor`` = 1), so a
bucket launches when its units have reduced and ``device_grad`` hands the D2H lane the local
shard. The CPU step, STV, rollback and the GPU tail's device step run on the local shards.
Validation is one all-reduce over every rank (shards are disjoint; under HSDP only the first
replica adds its sum of squares), "present" meaning what some rank used (hooks.py). A
``publish`` writes the stepped master (or bf16 copy) into the local shards FSDP2 all-gathers
from, and each unit's prepended pre-hook waits for it (hooks.py). Weight-flow is FSDP2's own
(flow.py): the engine streams nothing (``streamed`` is empty here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any
from typing import cast as typed

import torch
import torch.distributed as dist

from superoffload.distributed.budget import HostBudget, agree_host_budget, plan_host_bytes
from superoffload.distributed.fsdp import hooks
from superoffload.distributed.fsdp.comm import guard_collectives
from superoffload.distributed.fsdp.flow import check_flow_units
from superoffload.distributed.fsdp.units import Unit, fsdp_units
from superoffload.distributed.process_group import stall_cause
from superoffload.distributed.validation import agree_fingerprint, all_reduce_validation
from superoffload.kernels.optimizer_batches import is_dtensor, local_shard, state_like
from superoffload.plan.buckets import Bucket, BucketPlan
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.devices import GradStats
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Priority, describe
from superoffload.runtime.local_transport import LocalTransport
from superoffload.runtime.state import BucketBuffers, ParamState
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transport import (
    NO_CHECKS,
    Checks,
    GlobalStats,
    Published,
    TransportContext,
)


class FsdpTransport(LocalTransport):
    """The engine's buckets over an FSDP2-sharded model (see the module docstring). ``mesh``:
    the model's (2-D: HSDP); ``host_*``: the host memory check's inputs (budget.py)."""

    name = "fsdp"
    collective = True
    """Every rank steps together (FSDP2's collectives): an interrupted iteration fails the
    engine on every rank instead of rolling back on one."""
    ordered_launch = False
    """No collective per bucket: FSDP2 issued the reduce-scatters already."""
    grad_divisor = 1
    """FSDP2 averages the gradients over the ranks in its reduce-scatter."""

    def __init__(self, *, mesh: Any = None, host_available_bytes: int | None = None,
                 host_headroom: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FsdpTransport: initialise torch.distributed first "
                               "(superoffload.distributed.init_distributed under torchrun)")
        super().__init__()
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
        self._published: dict[int, Future[Any]] = {}
        self._handles: list[Any] = []
        self.units: list[Unit] = []
        self._prefetch: dict[int, list[Any]] = {}
        self.usage = hooks.UsageLog()
        self.sync_rule: Any = None
        """The engine's: weakly, ``() -> bool``, does this micro-step reduce (hooks.py)."""
        self._watchdog_s = 0.0
        """The watchdog of the iteration whose publishes are in flight."""

    # ------------------------------------------------------------------ set-up
    def start(self, ctx: TransportContext) -> None:
        from superoffload.distributed.budget import count_local_ranks

        self._ctx = ctx
        if ctx.fingerprint is not None:  # before any collective whose sizes depend on it
            self.agree(ctx.fingerprint)
        st = ctx.state
        plain = [st.names[i] for i in st.trainable if not is_dtensor(st.params[i])]
        if plain:
            raise ValueError(f"FsdpTransport: parameters {plain[:3]} are not FSDP2 shards; "
                             "call fully_shard on the model (and its blocks) before building "
                             "the engine, or build FsdpOffloadEngine, which shards it")
        self.units = fsdp_units(st.model)
        if self.mesh is None:
            self.mesh = st.params[st.trainable[0]].device_mesh  # type: ignore[attr-defined]
        if self.mesh.ndim == 2:  # HSDP: (replicate, shard)
            self.first_replica = self.mesh.get_local_rank(0) == 0
        self.shard_ranks = self.mesh.size(self.mesh.ndim - 1)
        modules = [m for u in self.units for m in u.modules]
        for module in modules:  # ranks may use different parameters (DDP's semantics)
            module.set_reduce_scatter_unused_params(True, recurse=False)
        guard_collectives([u.modules[0] for u in self.units])  # a dead peer: DistributedError
        self.local_ranks = count_local_ranks(self.group)
        super().start(ctx)  # the d2h and h2d lanes

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool, moments: torch.dtype = torch.float32,
              storage: Storage | None = None) -> list[BucketBuffers]:
        """Each rank allocates its local shard of every bucket from ``states`` (full tensors,
        or DTensors of the parameters' layout) and writes the masters into the shards (a
        load, a resharded resume)."""
        st, be = self.ctx.state, self.ctx.device_ops
        if flow and be.device.type != "cpu":
            check_flow_units(self.units, st.model)
        local = {b.id: [typed(torch.nn.Parameter, local_shard(st.params[i]))
                        for i in b.param_indices] for b in plan.buckets}
        tier_plan = self.store.place(
            plan, {b.id: sum(p.numel() for p in local[b.id]) for b in plan.host_buckets}, cast,
            flow, snapshot, moments, storage)
        numels = [[p.numel() for p in local[b.id]] for b in plan.buckets if not b.on_device]
        available, headroom = self._budget_args  # every rank agrees before allocating
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

        buffers = self.store.build(self.ctx, plan, lambda b: local[b.id], states_of, cast,
                                   flow=flow, moments=moments, tier_plan=tier_plan,
                                   storage=storage, rank=self.rank)
        self._install_hooks()
        return buffers

    def _install_hooks(self) -> None:
        self._remove_hooks()
        st = self.ctx.state
        bucket_of = st.bucket_of
        prefetch = self._prefetch
        self._handles = hooks.install(
            self.units, index={id(p): i for i, p in enumerate(st.params) if i in bucket_of},
            buckets_of=lambda idx: tuple(sorted({bucket_of[i] for i in idx})),
            prefetched=lambda unit: prefetch.get(id(unit), []), wait=self._wait_published,
            sync=self._sync, log=self.usage)

    def set_prefetch(self, units: Sequence[Any], depth: int) -> None:
        """FSDP2 all-gathers the next ``depth`` of ``units`` (forward order) during each
        one's forward; the publish waits follow (a prefetched unit's all-gather is issued
        in its predecessor's pre-hook)."""
        self._prefetch = {}
        for k, unit in enumerate(units):
            ahead = list(units[k + 1:k + 1 + depth])
            unit.set_modules_to_forward_prefetch(ahead)
            self._prefetch[id(unit)] = ahead
        if self._ctx is not None and self.buffers:
            self._install_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _wait_published(self, buckets: tuple[int, ...]) -> None:
        """Before FSDP2 all-gathers a unit: its buckets' last publish has landed (through the
        engine's waits: a lane's failure surfaces as the engine's error)."""
        futures = [f for b in buckets if (f := self._published.get(b)) is not None]
        in_flight, watchdog = self.ctx.in_flight, self._watchdog_s

        def wait(f: Future[Any]) -> Any:
            return in_flight.wait(f, "publish before FSDP2's all-gather", watchdog)

        hooks.wait_publish(futures, wait, self.units[0].modules[0] if self.units else None)

    def _sync(self) -> bool | None:
        rule = None if self.sync_rule is None else self.sync_rule()
        return None if rule is None else bool(rule())

    # ------------------------------------------------------------------ per iteration
    def device_grad(self, index: int) -> torch.Tensor | None:
        """FSDP2 writes each DTensor parameter's ``.grad``: its local shard moves."""
        g = self.ctx.state.params[index].grad
        return None if g is None else local_shard(g)

    def full_grad(self, index: int) -> torch.Tensor | None:
        """The gradient the optimizer reads, as a DTensor of the parameter's layout (this
        rank's host buffer as its local shard; ``.full_tensor()`` gathers it, collective)."""
        from torch.distributed.tensor import DTensor

        buf, k = self._where(index)
        p = self.ctx.state.params[index]
        if buf.on_device:
            g = p.grad
            return None if g is None else g.detach()
        host = self.store.host_grad(buf, k)
        return DTensor.from_local(host.to(p.device), p.device_mesh,  # type: ignore[attr-defined]
                                  p.placements, run_check=False, shape=p.shape,  # type: ignore[attr-defined]
                                  stride=p.stride())

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        grads = [g for b in buckets for i in self.buffers[b].bucket.param_indices
                 if (g := self.device_grad(i)) is not None]
        if not grads:
            return GradStats(0.0, 0)
        stats = self.ctx.device_ops.device_stats(grads)
        return stats if self.first_replica else GradStats(0.0, stats.nonfinite)

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        buf = self.buffers[b]
        return [g if (g := self.device_grad(i)) is not None else torch.zeros_like(p)
                for i, p in zip(buf.bucket.param_indices, buf.params)]

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        """One all-reduce of the validation vector over every rank; "present" is what this
        rank used (FSDP2 reduced zeros for the rest)."""
        used = present & frozenset(self.usage.used)
        if not self.first_replica:
            local = GradStats(0.0, local.nonfinite)
        return all_reduce_validation(local, used, checks, self.ctx.state.trainable,
                                     self.group, self.world_size, "all_reduce (validation)")

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        """Every rank built the same model, configuration and param groups (or all raise)."""
        agree_fingerprint(fingerprint, self.group, self.ranks)

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Published:
        # FSDP2's shards are the weights' only home: always written (weight-flow included:
        # nothing is streamed by the engine), the whole bucket: a parameter some rank stepped
        # speculatively and no rank used is rolled back, and its restored value must land too
        # (settle replays only the used)
        every = tuple(range(len(self.buffers[b].params)))
        self._watchdog_s = frozen.config.watchdog_s
        published = super().publish(b, every, after, replace(frozen, streamed=frozenset()),
                                    priority)
        if published.device is not None:  # what the unit's all-gather waits for
            self._published[b] = published.device
        return published

    def home(self, index: int) -> torch.Tensor:
        raise RuntimeError("FsdpTransport: weight-flow is FSDP2's (flow.py); the engine "
                           "streams no block itself")

    def stall_hint(self) -> str:
        lanes = ", ".join(describe(lane) for lane in self._lanes)
        return (f"transfer lanes: {lanes}; FSDP2's collectives run in backward and in its "
                f"forward pre-hooks, over ranks {self.ranks}: {stall_cause(self.ranks)}")

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        """Every trainable parameter's state as DTensors of its layout (CPU local shards):
        no communication; ``build`` takes them back (a re-plan), DCP saves them."""
        from torch.distributed.tensor import DTensor

        st = self.ctx.state
        out: dict[int, ParamState] = {}
        for b, states in self.store.export(st.steps, tier=tier).items():
            for i, state in zip(self.buffers[b].bucket.param_indices, states):
                p = st.params[i]

                def dt(t: torch.Tensor, p: Any = p) -> torch.Tensor:
                    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride())

                out[i] = ParamState(dt(state.master), dt(state.exp_avg),
                                    dt(state.exp_avg_sq), state.step)
        return out

    def close(self) -> None:
        self._remove_hooks()
        self.usage.close()
        self._published.clear()
        super().close()


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor whose local shard is on the CPU (``export_states``):
    gathered on the mesh's device (NCCL gathers device tensors), returned on the CPU."""
    from torch.distributed.tensor import DTensor

    mesh = t.device_mesh  # type: ignore[attr-defined]
    if mesh.device_type != "cpu":
        t = DTensor.from_local(t.to_local().to(mesh.device_type), mesh,  # type: ignore[attr-defined]
                               t.placements, run_check=False, shape=t.shape,  # type: ignore[attr-defined]
                               stride=t.stride())
    return t.full_tensor().cpu()  # type: ignore[attr-defined,no-any-return]


def _local_state(state: ParamState, p: torch.Tensor) -> ParamState:
    """This rank's shard of a parameter's state (a DTensor, or a full tensor from a load)."""
    master, exp_avg, exp_avg_sq = (local_shard(state_like(t, p, torch.float32))
                                   for t in (state.master, state.exp_avg, state.exp_avg_sq))
    return ParamState(master, exp_avg, exp_avg_sq, state.step)

