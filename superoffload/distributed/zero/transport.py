"""The ZeRO transport: reduce-scatter a bucket's gradients, all-gather its new weights (§4.6).

The offload engine runs one iteration core (runtime/scheduler.py, settle.py) over a
transport; this one makes it ZeRO-style data parallel. The optimizer state of each
offloaded bucket is partitioned (layout.py): rank r keeps only its 1/N slice of the fp32
master and both moments, on its own CPU, and steps only that slice. Per bucket:

1. its gradients are final -> flattened into the bucket's padded fp32 buffer and an async
   reduce-scatter is issued (the scheduler launches in bucket order, so every rank issues
   the same sequence); the ``reduce`` lane waits for it, copies the shard to the host and
   returns the shard's validation partials;
2. the CPU worker steps the shard (speculatively under STV); the ``gather`` lane
   all-gathers the updated low-precision (or fp32) shards back into the parameters —
   under weight-flow into the host homes the blocks stream from (homes.py);
3. validation: one all-reduce of [sum of squares, non-finite count, which parameters got a
   gradient] gives every rank the same verdict (the partials are disjoint, so the sum is
   exact; the tail, replicated, is counted on the first rank only).

GPU tail buckets are replicated, not sharded: their gradients are all-reduced as they
complete and every rank steps the whole tail on its device (their state is small by
construction, and the first layers' forward then needs no gather). Gradients are summed,
not averaged, on the wire (``grad_divisor`` = N: the 1/N goes into the kernel's factor); the
reduce runs in fp32 whatever the model dtype (bf16 sums of N ranks lose bits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.launch import collective_guard, new_group_like
from superoffload.distributed.zero.budget import (
    DEFAULT_HEADROOM,
    HostBudget,
    available_host_bytes,
    shard_host_bytes,
)
from superoffload.distributed.zero.buffers import (
    ShardBucket,
    build_shard_bucket,
    export_segments,
    fill_grad_flat,
)
from superoffload.distributed.zero.comm import (
    GatherTask,
    ReduceTask,
    agree_fingerprint,
    all_reduce_validation,
    issue_reduce,
    resolve_reduce_mode,
)
from superoffload.distributed.zero.gather import gather_full_states
from superoffload.distributed.zero.homes import alloc_homes, fill_homes, gather_targets
from superoffload.distributed.zero.layout import shard_layout
from superoffload.distributed.zero.startup import (
    agree_host_budget,
    broadcast_model,
    count_local_ranks,
)
from superoffload.plan.buckets import BucketPlan
from superoffload.runtime.backend import GradStats
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.state import BucketBuffers, ParamState, adopt_value, build_buffers
from superoffload.runtime.transport import (
    NO_CHECKS,
    Checks,
    GlobalStats,
    LaneOwner,
    Published,
    TransportContext,
)
from superoffload.runtime.worker import Priority, describe, make_lane


def resolve_group(group: Any) -> Any:
    """The group whose ranks share the offloaded state: ``group`` if given, else the dp
    group of ``init_distributed`` — or, with Ulysses (sp > 1), the world group: every rank
    then holds the full weights and computes gradients from its own tokens, so the reduction
    spans all dp*sp ranks (docs/distributed.md, "dp x sp")."""
    if group is not None:
        return group
    from superoffload.distributed import launch

    try:
        info = launch.dist_info()
    except RuntimeError:
        return dist.group.WORLD
    layout = launch.get_groups()
    return layout.dp_group if info.sp == 1 else layout.world_group


class ZeroTransport(LaneOwner):
    """Sharded buckets over a process group (see the module docstring)."""

    name = "zero"
    ordered_launch = True

    def __init__(self, *, group: Any = None, reduce_mode: str = "auto",
                 local_world_size: int | None = None, host_headroom: float = DEFAULT_HEADROOM,
                 host_available_bytes: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ZeroOffloadEngine: call superoffload.distributed."
                               "init_distributed() first (under torchrun)")
        self.group = resolve_group(group)
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank()
        """Global rank (telemetry)."""
        self.shard_rank = self.ranks.index(self.rank)
        """Position in the group: which slice of every bucket this rank owns."""
        self.grad_divisor = self.world_size = len(self.ranks)
        self.local_ranks = local_world_size or 1
        self._local_arg = local_world_size
        self._reduce_arg = reduce_mode
        self.reduce_mode = reduce_mode
        self.headroom, self.available_arg = host_headroom, host_available_bytes
        self.host_budget: HostBudget | None = None
        self.shards: dict[int, ShardBucket] = {}
        self.tails: dict[int, BucketBuffers] = {}
        self.homes: dict[int, torch.Tensor] = {}
        self._tail_grads: dict[int, torch.Tensor] = {}
        self._tail_work: dict[int, Any] = {}
        self._gather_stream: Any = None

    # ------------------------------------------------------------------ set-up
    def start(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        if ctx.fingerprint is not None:  # before any collective whose sizes depend on it
            self.agree(ctx.fingerprint)
        # Two groups of the same ranks: gradients + validation (training thread), weights
        # (gather lane). One thread drives each, so every rank issues the same sequence.
        self.grad_group = new_group_like(self.ranks)
        self.weight_group = new_group_like(self.ranks)
        broadcast_model(ctx.state.model, self.grad_group, self.ranks[0])
        self.local_ranks = self._local_arg or count_local_ranks(self.grad_group)
        self.reduce_mode = resolve_reduce_mode(self._reduce_arg, self.grad_group,
                                               ctx.backend.device)
        self._lanes = tuple(make_lane(n, inline=ctx.inline, on_error=ctx.on_error)
                            for n in ("reduce", "gather"))
        if ctx.backend.device.type == "cuda":
            self._gather_stream = torch.cuda.Stream(ctx.backend.device)

    def _check_budget(self, plan: BucketPlan, cast: CastPolicy, flow: bool,
                      snapshot: bool, moments: torch.dtype) -> None:
        """This rank's host bytes (its shards), checked by all ranks before allocating."""
        dtype = self.ctx.state.model_dtype
        lp_bytes = 0 if dtype == torch.float32 else dtype.itemsize
        rank_bytes = sum(
            shard_host_bytes(-(-b.numel // self.world_size), grad_bytes=4, lp_bytes=lp_bytes,
                             snapshot=snapshot, moment_bytes=2 * moments.itemsize)
            for b in plan.buckets if not b.on_device)
        if flow:  # the gathered homes: every weight, model dtype
            rank_bytes += sum(b.numel for b in plan.buckets) * dtype.itemsize
        available = available_host_bytes() if self.available_arg is None else self.available_arg
        self.host_budget = HostBudget(rank_bytes, self.local_ranks, available, self.headroom)
        agree_host_budget(self.host_budget, self.grad_group, self.ctx.backend.device,
                          self.shard_rank)

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool,
              moments: torch.dtype = torch.float32) -> list[BucketBuffers]:
        """Every rank allocates its slice of each bucket from full ``states``; the resident
        parameters are set to the masters' values (a resharded load needs it)."""
        self._check_budget(plan, cast, flow, snapshot, moments)  # before anything is allocated
        st, be = self.ctx.state, self.ctx.backend
        self.shards, self.tails, self.homes = {}, {}, {}
        with torch.no_grad():
            for b in plan.buckets:
                for i in b.param_indices:
                    if st.params[i].numel() == st.shapes[i].numel():  # not a released block
                        st.params[i].data.copy_(states[i].master)
        out: list[BucketBuffers] = []
        for bucket in plan.buckets:
            params = [st.params[i] for i in bucket.param_indices]
            sts = [states[i] for i in bucket.param_indices]
            if bucket.on_device:
                self.tails[bucket.id] = build_buffers(
                    bucket, params, sts, alloc_host=be.alloc_host, alloc_device=be.alloc_device,
                    grad_host_dtype=torch.float32, lp_host=False)
                out.append(self.tails[bucket.id])
                continue
            numels = [st.shapes[i].numel() for i in bucket.param_indices]  # flow: released
            layout = shard_layout(numels, rank=self.shard_rank, world_size=self.world_size)
            sb = self.shards[bucket.id] = build_shard_bucket(
                bucket, params, sts, layout, backend=be, model_dtype=st.model_dtype,
                reduce_mode=self.reduce_mode, moment_dtype=moments)
            if flow:
                homes = alloc_homes(sb, be)
                fill_homes(sb, homes, [s.master for s in sts])
                self.homes.update(zip(bucket.param_indices, homes))
            out.append(sb.state)
        self._tail_grads = {b: be.alloc_device(buf.bucket.numel, torch.float32)
                            for b, buf in self.tails.items()}
        self._tail_work = {}
        return out

    # ------------------------------------------------------------------ per iteration
    def launch(self, b: int, present: tuple[int, ...], iteration: int,
               streamed: frozenset[int]) -> Future[Any] | None:
        ctx = self.ctx
        if b in self.tails:
            flat, offset = self._tail_grads[b], 0
            with torch.no_grad():
                for p in self.tails[b].params:
                    view = flat[offset:offset + p.numel()]
                    if p.grad is None:
                        view.zero_()  # no gradient on this rank: it still joins the sum
                    else:
                        view.copy_(p.grad.reshape(-1))
                    offset += p.numel()
            with collective_guard(f"all_reduce of tail bucket {b}", self.grad_group):
                self._tail_work[b] = dist.all_reduce(flat, group=self.grad_group, async_op=True)
            return None
        sb = self.shards[b]
        fill_grad_flat(sb)
        for p, i in zip(sb.params, sb.bucket.param_indices):
            if i in streamed:  # the gradient is in the reduce buffer: free its device copy
                p.grad = None
        with collective_guard(f"reduce of bucket {b}", self.grad_group):
            work = issue_reduce(sb.grad_flat, sb.grad_shard, self.grad_group, self.reduce_mode)
        return self._lanes[0].submit(ReduceTask(b, iteration, work, sb.grad_shard, sb.grad_host,
                                                ctx.backend, ctx.recorder))

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        flat, out, offset = self._tail_grads[b], [], 0
        for p in self.tails[b].params:
            out.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        sum_sq, nonfinite = 0.0, 0
        for b in buckets:
            with collective_guard(f"all_reduce of tail bucket {b}", self.grad_group):
                self._tail_work.pop(b).wait()
            stats = self.ctx.backend.device_stats(self.tail_grads(b))
            if self.shard_rank == 0:  # replicated on every rank: counted once
                sum_sq += stats.sum_sq
            nonfinite += stats.nonfinite
        return GradStats(sum_sq, nonfinite)

    def discard(self, buckets: Sequence[int]) -> None:
        for b in buckets:
            work = self._tail_work.pop(b, None)
            if work is not None:
                with collective_guard(f"all_reduce of tail bucket {b}", self.grad_group):
                    work.wait()

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        return all_reduce_validation(local, present, checks, self.ctx.state.trainable,
                                     self.grad_group, self.world_size, self.ctx.backend.device,
                                     "all_reduce (validation)")

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        agree_fingerprint(fingerprint, self.group, self.ranks)

    def adopt(self, indices: Sequence[int]) -> None:
        st = self.ctx.state
        params = st.params
        want = set(indices)
        for buf in self.tails.values():
            for k, i in enumerate(buf.bucket.param_indices):
                if i in want and buf.master[k].data_ptr() != params[i].data_ptr():
                    adopt_value(buf.master[k], params[i], None)
        for i in want & self.homes.keys():  # weight-flow: the full host copies forwards fetch
            if params[i].numel():
                self.homes[i].copy_(params[i].detach().reshape(self.homes[i].shape))
        for sb in self.shards.values():  # this rank's pieces of each written parameter
            seg_state = sb.state
            for k, seg in enumerate(sb.layout.segments):
                i = sb.bucket.param_indices[seg.pos]
                if i in want:
                    lo, hi = seg.param_offset, seg.param_offset + seg.numel
                    adopt_value(seg_state.master[k], params[i].detach().reshape(-1)[lo:hi],
                                None if seg_state.lp_host is None else seg_state.lp_host[k])

    def restore(self, indices: Sequence[int]) -> list[int]:
        st = self.ctx.state
        want, lost = set(indices), []
        with torch.no_grad():
            for sb in self.shards.values():  # the last all-gathered weights are still there
                for pos, i in enumerate(sb.bucket.param_indices):
                    if i in want:
                        st.params[i].data.copy_(sb.weight_views[pos])
            for buf in self.tails.values():  # replicated: the master on the device
                for k, i in enumerate(buf.bucket.param_indices):
                    if i not in want:
                        continue
                    if buf.master[k].data_ptr() != st.params[i].data_ptr():
                        st.params[i].data.copy_(buf.master[k])
                    else:
                        lost.append(i)
        self.ctx.backend.synchronize()
        return lost

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any], iteration: int,
                streamed: frozenset[int], priority: Priority) -> Published:
        # collective: every rank gathers the whole bucket, whatever it stepped itself, and in
        # the training thread's order (FIFO, the task waits for its step): all-gathers match
        # by issue order, so they are never reordered by completion or deadline
        sb, ctx = self.shards[b], self.ctx
        views, dst = gather_targets(sb, self.homes, streamed)
        fut = self._lanes[1].submit(GatherTask(
            b, iteration, after, sb.publish_host, sb.weight_shard_device, sb.weight_flat,
            views, dst, self.weight_group, self._gather_stream, ctx.recorder, ctx.watchdog_s()))
        return Published(fut, fut if self.homes else None)

    def home(self, index: int) -> torch.Tensor:
        return self.homes[index]

    def stall_hint(self) -> str:
        from superoffload.distributed.launch import (
            collective_timeout_s,
            exited_peers,
            stopped_peers,
        )

        lanes = ", ".join(describe(lane) for lane in self._lanes)
        stopped, gone = stopped_peers(self.ranks), exited_peers(self.ranks)
        who = (f"rank(s) {stopped} on this host are stopped" if stopped else
               f"rank(s) {gone} on this host have exited" if gone else
               "no local peer is stopped or gone: look at the other hosts' ranks")
        return (f"collective lanes: {lanes}, over ranks {self.ranks} with a "
                f"{collective_timeout_s():g} s collective timeout; {who}")

    # ------------------------------------------------------------------ state
    def export_states(self) -> dict[int, ParamState]:
        """Full state of every trainable parameter on every rank. Collective."""
        st = self.ctx.state
        return gather_full_states(self.shards, self.tails, st.shapes, st.steps,
                                  self.ctx.backend.device, self.grad_group)

    def export_segments(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's (param index, offset, master, exp_avg, exp_avg_sq) pieces."""
        return [seg for sb in self.shards.values() for seg in export_segments(sb)]

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()
        self.shards, self.tails, self.homes = {}, {}, {}
