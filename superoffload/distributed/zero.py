"""ZeRO-style data parallel over the offload engine's schedule (issue 7; paper §4.6).

Every rank runs the same model on its own micro-batches. The optimizer state of each
offloaded bucket is partitioned (zero_layout.py): rank r keeps only its 1/N slice of the
fp32 master and both moments, on its own CPU, and steps only that slice. Per iteration:

1. backward: when a bucket's last gradient is final (post-accumulate-grad hook), its
   gradients are flattened and an async reduce-scatter is *issued* (in bucket order, so every
   rank issues the same sequence; a bucket completed early waits for its predecessors);
   the D2H lane waits for it, copies the shard to the host and returns the shard's
   validation partials; the CPU worker then steps the shard *speculatively* (STV, §4.3) and
   the gather lane all-gathers the updated bf16 (or fp32) shards back into the parameters;
2. ``step()``: one all-reduce of [sum of squares, non-finite count] over the ranks gives
   the global norm and overflow flag (the partials are disjoint, so their sum is exact);
   the verdict is the same on every rank; CLIP rolls each rank's shard back and replays it
   with the clipped gradient (still in the host buffer), SKIP rolls back, and either is
   followed by a second all-gather of the restored/replayed weights;
3. the next forward: each module waits for its own bucket's last all-gather only.

GPU tail buckets are *replicated*, not sharded: their gradients are all-reduced as they
complete and every rank steps the whole tail on its device with the same factor (their
state is small by construction, and the first layers' forward then needs no gather).

Gradients are summed, not averaged, on the wire; the 1/N goes into the kernel's
``grad_scale`` with the loss-scale and clip factors, and the norm is divided by N.
The reduce runs in fp32 whatever the model dtype (bf16 sums of N ranks lose bits).

Sequence parallel (Ulysses, sp > 1): the default group is then every rank (dp*sp), each
rank back-propagating the mean loss of its own sequence shard; the 1/N average over all
ranks is the global-batch mean gradient (docs/distributed.md, "dp x sp").

Weight-flow (``OffloadConfig.weights="flow"``): every bucket is offloaded (ratio 1), the
all-gather writes the blocks' weights into their host homes and each block streams in per
fetch (zero_flow.py). Not here (yet): ``weights="auto"`` (runs stationary),
``reconfigure()``. Checkpoints: zero_checkpoint.py.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from superoffload.config import OffloadConfig
from superoffload.distributed import launch, zero_hooks
from superoffload.distributed.zero_budget import (
    DEFAULT_HEADROOM,
    HostBudget,
    available_host_bytes,
    shard_host_bytes,
    threads_per_rank,
)
from superoffload.distributed.zero_buffers import ShardBucket, build_shard_bucket, fill_grad_flat
from superoffload.distributed.zero_comm import (
    GatherTask,
    ReduceTask,
    issue_reduce,
    resolve_reduce_mode,
)
from superoffload.distributed.zero_flow import (
    ZeroWeightFlow,
    alloc_homes,
    fill_homes,
    free_streamed_grads,
    gather_targets,
)
from superoffload.distributed.zero_layout import shard_layout
from superoffload.distributed.zero_setup import (
    agree_host_budget,
    broadcast_model,
    count_local_ranks,
)
from superoffload.distributed.zero_step import Flight, close_iteration, settle, validate
from superoffload.plan.buckets import BucketPlan, ParamSpec, plan_buckets
from superoffload.runtime.backend import make_backend
from superoffload.runtime.engine import EngineStats
from superoffload.runtime.iteration import Barrier
from superoffload.runtime.lifetime import EngineLifetime
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import EngineOptimizer, hyper_of, param_groups_from
from superoffload.runtime.state import BucketBuffers, ParamState, build_buffers, initial_state
from superoffload.runtime.steps import KernelCall, StepTask
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.worker import Lane, make_lane
from superoffload.telemetry.events import KIND_BACKWARD, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder


@dataclass(slots=True)
class _Iteration:
    micro_step: int = 0
    armed: bool = False
    speculate: bool = False
    fired: dict[int, set[int]] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)
    next_issue: int = 0
    flights: dict[int, Flight] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


class ZeroOffloadEngine(EngineLifetime):
    """Data-parallel offload engine; build it on every rank after ``init_distributed()``.

    Same training API as ``OffloadEngine``: ``backward(loss)``, ``step()``, ``zero_grad()``,
    ``optimizer`` (for LR schedulers), ``synchronize()``, ``close()``; plus the collective
    ``full_master_weights()`` and the sharded ``save_checkpoint``/``load_checkpoint``.
    ``reduce_mode``: "auto", "reduce_scatter" or "all_reduce" (zero_comm.py).
    """

    def __init__(self, model: torch.nn.Module,
                 optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                 config: OffloadConfig, telemetry: Recorder | None = None, *,
                 group: Any = None, reduce_mode: str = "auto", inline: bool = False,
                 local_world_size: int | None = None, host_headroom: float = DEFAULT_HEADROOM,
                 host_available_bytes: int | None = None) -> None:
        self.config = config.validate()
        self.flow: ZeroWeightFlow | None = None
        flow = config.weights == "flow"  # "auto" runs weight-stationary here
        if not dist.is_initialized():
            raise RuntimeError("ZeroOffloadEngine: call superoffload.distributed."
                               "init_distributed() first (under torchrun)")
        if group is None:
            try:
                info = launch.dist_info()
            except RuntimeError:
                group = dist.group.WORLD
            else:
                # With Ulysses (sp > 1) every rank holds the full weights and computes
                # gradients from its own tokens, so the reduction spans all dp*sp ranks: the
                # state is sharded over the world group (docs/distributed.md, "dp x sp").
                layout = launch.get_groups()
                group = layout.dp_group if info.sp == 1 else layout.world_group
        ranks = dist.get_process_group_ranks(group)
        self.rank, self.world_size = ranks.index(dist.get_rank()), len(ranks)
        # Two groups of the same ranks: gradients + validation (training thread), weights
        # (gather lane). One thread drives each, so every rank issues the same sequence.
        self.grad_group = dist.new_group(ranks)
        self.weight_group = dist.new_group(ranks)
        self.model = model
        self.telemetry = telemetry or Recorder(enabled=config.telemetry,
                                               max_events=config.telemetry_max_events,
                                               rank=dist.get_rank())
        self.backend = make_backend(config.device, pin_memory=config.pin_memory)
        self.reduce_mode = resolve_reduce_mode(reduce_mode, self.grad_group, self.backend.device)
        self.iteration, self.stats = 0, EngineStats()
        self._closed, self._lock, self._error_lock = False, threading.Lock(), threading.Lock()
        self._error: tuple[str, BaseException] | None = None
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._params: list[torch.nn.Parameter] = [p for _, p in named]
        self._shapes = [p.shape for p in self._params]  # streamed ones are released later
        self._index = {id(p): i for i, p in enumerate(self._params)}
        groups = param_groups_from(model, optimizer)
        self._group_of = {self._index[id(p)]: g for g, grp in enumerate(groups) for p in grp["params"]}
        self._trainable = [i for i, p in enumerate(self._params)
                           if p.requires_grad and i in self._group_of]
        if not self._trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {self._params[i].dtype for i in self._trainable}
        if len(dtypes) != 1:
            raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; use one")
        self.model_dtype = dtypes.pop()
        broadcast_model(model, self.grad_group, ranks[0])
        self.local_world_size = local_world_size or count_local_ranks(self.grad_group)
        self.threads = config.cpu_threads or threads_per_rank(self.local_world_size,
                                                              config.cpu_cores_frac)
        specs = [ParamSpec(i, self._params[i].numel(), True, self._names[i])
                 for i in self._trainable]
        # weight-flow offloads every bucket (§4.5): the all-gather fills the blocks' homes
        self.bucket_plan: BucketPlan = plan_buckets(specs, bucket_bytes=config.bucket_bytes,
                                                    ratio=1.0 if flow else config.ratio)
        # before anything is allocated or started (lanes are threads)
        self.host_budget = self._check_budget(host_headroom, host_available_bytes)
        self._steps = [0] * len(self._params)
        self.optimizer = EngineOptimizer(groups, step_fn=self._step_impl,
                                         zero_grad_fn=self._zero_grad_impl,
                                         state_fn=self._no_state, load_fn=self._no_state)
        self.scaler = LossScaler.for_model(config, self.model_dtype)
        self.adaptive = AdaptiveSTV(mode=config.speculation, window=config.adaptive_window,
                                    threshold=config.adaptive_threshold)
        self._lanes: list[Lane] = [make_lane(n, inline=inline, on_error=self._on_lane_error)
                                   for n in ("reduce", "cpu_worker", "gather")]
        self.reduce_lane, self.worker, self.gather_lane = self._lanes
        self._home_ready: dict[int, Future[Any]] = {}
        """Weight-flow: per bucket, the last all-gather into its homes (zero_flow.py)."""
        self._homes: dict[int, torch.Tensor] = {}
        self._gather_stream = (torch.cuda.Stream(self.backend.device)
                               if self.backend.device.type == "cuda" else None)
        self._pending: dict[int, Future[Any]] = {}
        self._it = _Iteration()
        self.build({i: initial_state(self._params[i]) for i in self._trainable})
        self._hooks = zero_hooks.register(self)
        if flow:
            self.fetch_lane = make_lane("fetch", inline=inline, on_error=self._on_lane_error)
            self._lanes.append(self.fetch_lane)
            self.flow = ZeroWeightFlow(self, config.prefetch_depth, self.fetch_lane)
            self.flow.attach()
            self._hooks.append(model.register_forward_pre_hook(self._begin_forward))

    # ------------------------------------------------------------------ setup
    def _check_budget(self, headroom: float, available: int | None) -> HostBudget:
        """This rank's host bytes (its shards of the offloaded buckets), checked by all."""
        lp_bytes = 0 if self.model_dtype == torch.float32 else self.model_dtype.itemsize
        rank_bytes = sum(
            shard_host_bytes(-(-b.numel // self.world_size), grad_bytes=4, lp_bytes=lp_bytes,
                             snapshot=self.config.rollback == "snapshot")
            for b in self.bucket_plan.buckets if not b.on_device)
        if self.config.weights == "flow":  # the gathered homes: every weight, model dtype
            rank_bytes += sum(b.numel for b in self.bucket_plan.buckets) * self.model_dtype.itemsize
        budget = HostBudget(rank_bytes, self.local_world_size,
                            available_host_bytes() if available is None else available, headroom)
        agree_host_budget(budget, self.grad_group, self.backend.device, self.rank)
        return budget

    def build(self, states: Mapping[int, ParamState]) -> None:
        """(Re)allocate every bucket from full per-parameter ``states`` (each rank keeps its
        slice); the parameters are set to the masters' values in the model dtype."""
        self._shards: dict[int, ShardBucket] = {}
        self._tails: dict[int, BucketBuffers] = {}
        self._bucket_of: dict[int, int] = {}
        self._home_ready.clear()
        with torch.no_grad():
            for i in self._trainable:
                if self.flow is None or not self.flow.is_streamed(self._params[i]):
                    self._params[i].data.copy_(states[i].master)  # a released one: its home
                self._steps[i] = states[i].step
        for bucket in self.bucket_plan.buckets:
            params = [self._params[i] for i in bucket.param_indices]
            sts = [states[i] for i in bucket.param_indices]
            for i in bucket.param_indices:
                self._bucket_of[i] = bucket.id
            if bucket.on_device:
                self._tails[bucket.id] = build_buffers(
                    bucket, params, sts, alloc_host=self.backend.alloc_host,
                    alloc_device=self.backend.alloc_device, grad_host_dtype=torch.float32,
                    lp_host=False)
                continue
            numels = [self._shapes[i].numel() for i in bucket.param_indices]  # flow: released
            layout = shard_layout(numels, rank=self.rank, world_size=self.world_size)
            sb = self._shards[bucket.id] = build_shard_bucket(
                bucket, params, sts, layout, backend=self.backend, model_dtype=self.model_dtype,
                reduce_mode=self.reduce_mode)
            if self.config.weights == "flow":
                fill_homes(self, sb, alloc_homes(sb, self.backend), [st.master for st in sts])
        self._tail_grads: dict[int, torch.Tensor] = {
            b: self.backend.alloc_device(buf.bucket.numel, torch.float32)
            for b, buf in self._tails.items()}

    # ------------------------------------------------------------------ per bucket
    def _mark_ready(self, b: int) -> None:
        """Issue collectives strictly in bucket order (caller holds the lock)."""
        it = self._it
        it.ready.add(b)
        while it.next_issue in it.ready:
            self._issue(it.next_issue)
            it.next_issue += 1

    def _calls(self, positions: Sequence[tuple[int, int]]) -> tuple[KernelCall, ...]:
        """KernelCalls over (member, param index) pairs grouped by (group, next step)."""
        groups = self.optimizer.param_groups
        keyed: dict[tuple[int, int], list[int]] = {}
        for member, index in positions:
            key = (self._group_of[index], self._steps[index] + 1)
            keyed.setdefault(key, []).append(member)
        return tuple(KernelCall(tuple(m), step, hyper_of(groups[g]))
                     for (g, step), m in sorted(keyed.items()))

    def _issue(self, b: int) -> None:
        it, n = self._it, self.iteration
        if b in self._tails:
            buf, flat = self._tails[b], self._tail_grads[b]
            offset = 0
            with torch.no_grad():
                for p in buf.params:
                    view = flat[offset:offset + p.numel()]
                    if p.grad is None:
                        view.zero_()  # no gradient on this rank: it still joins the sum
                    else:
                        view.copy_(p.grad.reshape(-1))
                    offset += p.numel()
            calls = self._calls([(pos, i) for pos, i in enumerate(buf.bucket.param_indices)])
            with launch.collective_guard(f"all_reduce of tail bucket {b}", self.grad_group):
                work = dist.all_reduce(flat, group=self.grad_group, async_op=True)
            it.flights[b] = Flight(b, calls, on_device=True, work=work)
            return
        sb = self._shards[b]
        fill_grad_flat(sb)
        free_streamed_grads(self, sb)
        with launch.collective_guard(f"reduce of bucket {b}", self.grad_group):
            work = issue_reduce(sb.grad_flat, sb.grad_shard, self.grad_group, self.reduce_mode)
        reduce = self.reduce_lane.submit(ReduceTask(
            b, n, work, sb.grad_shard, sb.grad_host,
            self.backend, self.telemetry))
        fl = Flight(b, self._calls(list(enumerate(sb.segment_param_indices()))), reduce=reduce)
        if it.speculate:
            if self.config.rollback == "snapshot":
                sb.state.ensure_snapshot(self.backend.alloc_host)
            fl.spec_scale = 1.0 / (self.scaler.loss_scale * self.world_size)
            fl.spec = self.worker.submit(self.step_task(fl, scale=fl.spec_scale, after=reduce,
                                                        speculative=True, replay=False))
            self.gather(b, after=fl.spec)
        it.flights[b] = fl

    def step_task(self, fl: Flight, *, scale: float, after: Future[Any] | None,
                  speculative: bool, replay: bool) -> StepTask:
        return StepTask(
            bucket=fl.bucket, iteration=self.iteration, buffers=self._shards[fl.bucket].state,
            calls=fl.calls, grad_scale=scale, threads=self.threads, after=after,
            skip_nonfinite=speculative, snapshot=speculative and self.config.rollback == "snapshot",
            replay=replay, recorder=self.telemetry, watchdog_s=self.config.watchdog_s)

    def gather(self, b: int, *, after: Future[Any] | None) -> None:
        sb = self._shards[b]
        views, dst = gather_targets(self, sb)
        fut = self.gather_lane.submit(GatherTask(
            b, self.iteration, after, sb.publish_host, sb.weight_shard_device, sb.weight_flat,
            views, dst, self.weight_group, self._gather_stream, self.telemetry,
            self.config.watchdog_s))
        self._pending[b] = fut
        if self.flow is not None:
            self._home_ready[b] = fut  # the next fetch of its blocks waits for it

    # ------------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor) -> None:
        self._raise_if_failed()
        it = self._it
        if it.micro_step == 0:
            it.speculate = self.adaptive.enabled
            self.stats.speculation_enabled = self.adaptive.enabled
        it.micro_step += 1
        it.armed = it.micro_step >= self.config.grad_accum_steps
        scale = self.scaler.loss_scale / self.config.grad_accum_steps
        with self.telemetry.span(LANE_COMPUTE, KIND_BACKWARD, iteration=self.iteration):
            (loss * scale if scale != 1.0 else loss).backward()
        it.losses.append(float(loss.detach()))
        if it.armed:
            with self._lock:  # buckets some of whose parameters got no gradient
                for b in range(len(self.bucket_plan.buckets)):
                    self._mark_ready(b)
        self._raise_if_failed()

    def step(self) -> None:
        self.optimizer.step()

    def _begin_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.flow is not None and torch._C._current_graph_task_id() == -1:
            self.flow.begin_forward()

    def _step_impl(self) -> None:
        self._raise_if_failed()
        it = self._it
        if 0 < it.micro_step < self.config.grad_accum_steps:
            return
        if self.flow is not None:
            self.flow.end_backward()
        if it.micro_step == 0:  # a plain loss.backward(): no overlap, no speculation
            it.speculate, it.armed = False, True
            with self._lock:
                for b in range(len(self.bucket_plan.buckets)):
                    self._mark_ready(b)
        v = validate(self, [it.flights[b] for b in sorted(it.flights)])
        settle(self, [it.flights[b] for b in sorted(it.flights)], v)
        close_iteration(self, v)
        self._it = _Iteration()
        self._raise_if_failed()

    def synchronize(self) -> None:
        """Wait for every lane; then the parameters hold the latest weights."""
        self._raise_if_failed()
        for lane in self._lanes:
            self._wait(lane.submit(Barrier()), f"lane {lane.name}")
        for b, fut in list(self._pending.items()):
            self.backend.wait(self._wait(fut, f"all-gather of bucket {b}"))
        self._pending.clear()
        self.backend.synchronize()
        self._raise_if_failed()

    # ------------------------------------------------------------------ state
    def full_master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master of every trainable parameter (CPU). Collective: call on every rank."""
        from superoffload.distributed.zero_checkpoint import gather_full_states

        return {self._names[i]: s.master for i, s in gather_full_states(self).items()}

    def save_checkpoint(self, path: str, extra: Any = None, *, lr_scheduler: Any = None) -> str:
        """Sharded: one file per rank plus a manifest (zero_checkpoint.py). Collective."""
        from superoffload.distributed import zero_checkpoint

        return zero_checkpoint.save(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        """Load a sharded checkpoint written by any world size. Collective; returns extra."""
        from superoffload.distributed import zero_checkpoint

        return zero_checkpoint.load(self, path, lr_scheduler=lr_scheduler)

    def _no_state(self, *args: Any) -> Any:
        raise TypeError("ZeroOffloadEngine's state is sharded across ranks: use "
                        "save_checkpoint()/load_checkpoint(), or zero_checkpoint.consolidate()")

    # ------------------------------------------------------------------ failures, lifetime
    def _on_lane_error(self, lane: str, exc: BaseException) -> None:
        with self._error_lock:  # not self._lock: inline lanes run under it
            if self._error is None:
                self._error = (lane, exc)

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError("the ZeRO offload engine is closed")
        if self._error is not None:
            lane, exc = self._error
            if isinstance(exc, launch.DistributedError):
                raise launch.DistributedError(f"{exc} (on the engine's {lane} lane)") from exc
            raise RuntimeError(f"the engine's {lane} lane failed: {exc!r}") from exc

    def close(self) -> None:
        """Stop the lanes and remove the hooks. Idempotent; not collective."""
        if self._closed:
            return
        if self.flow is not None and self._error is None:
            # leave the model holding its latest weights, as weight-stationary does
            try:
                self.synchronize()
                self.flow.detach()
            finally:
                self.flow = None
        self._closed = True
        for lane in self._lanes:
            lane.close()
        for h in self._hooks:
            h.remove()
        self._hooks, self._pending = [], {}
