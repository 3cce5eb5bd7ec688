"""The collectives of ZeRO data parallel, as lane tasks (frozen dataclasses, runtime/worker.py).

Per bucket and iteration (paper §4.6 with ZeRO's partitioning, Rajbhandari et al. 2020):

1. when its gradients are final, the training thread flattens them into the bucket's padded
   fp32 buffer and *issues* an async reduce-scatter (``issue_reduce``); rank r receives the
   sum of everybody's gradient over its own range;
2. ``ReduceTask`` (D2H lane) waits for it, copies the shard to the host buffer the CPU step
   reads and returns the shard's validation partials (sum of squares, non-finite count);
3. after the CPU step of the shard, ``GatherTask`` (its own lane) all-gathers the updated
   low-precision (or fp32) shards into the bucket's flat weight buffer and copies each
   parameter's slice into the model before the module that needs it runs.

Reduce-scatter on gloo: PyTorch's gloo backend implements it in the versions we checked
(torch 2.13); some older ones raise "not supported". ``reduce_mode="auto"`` therefore probes
once and falls back to an all-reduce of the whole bucket followed by taking the own slice
(same result, N times the receive bytes); ``"all_reduce"`` forces that path (tested).

Ordering: a process group matches collectives by issue order, so each group is driven by one
thread in an order every rank shares: the gradient group by the training thread (in bucket
order, see zero.py), the weight group by the gather lane (FIFO of the training thread's
submissions). Gloo and NCCL both allow different threads to drive different groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.launch import collective_guard
from superoffload.runtime.backend import Backend, GradStats, PendingStats
from superoffload.runtime.guard import RanksDisagree, first_difference
from superoffload.runtime.transfers import wait_for
from superoffload.runtime.transport import (
    Checks,
    GlobalStats,
    validation_result,
    validation_vector,
)
from superoffload.telemetry.events import KIND_D2H, KIND_H2D, LANE_D2H, LANE_H2D
from superoffload.telemetry.recorder import Recorder

REDUCE_MODES = ("auto", "reduce_scatter", "all_reduce")

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_reduce_mode(mode: str, group: Any, device: torch.device) -> str:
    """"auto" -> "reduce_scatter" when the backend implements it, else "all_reduce".

    The probe is one tiny collective on ``group``; every rank runs the same torch build, so
    every rank takes the same branch (a backend without it raises before communicating)."""
    if mode not in REDUCE_MODES:
        raise ValueError(f"reduce_mode={mode!r}: use one of {REDUCE_MODES}")
    if mode != "auto":
        return mode
    n = dist.get_world_size(group)
    probe_in = torch.zeros(n, dtype=torch.float32, device=device)
    probe_out = torch.zeros(1, dtype=torch.float32, device=device)
    try:
        with collective_guard("reduce_scatter (probe)", group):
            _reduce_scatter(probe_out, probe_in, group=group)
    except (RuntimeError, NotImplementedError) as exc:
        if "support" not in str(exc).lower():
            raise
        return "all_reduce"
    return "reduce_scatter"


def issue_reduce(flat: torch.Tensor, shard: torch.Tensor, group: Any, mode: str) -> Any:
    """Start summing ``flat`` (padded, one bucket) over ``group``; when the returned work is
    done, ``shard`` holds this rank's slice of the sum. In "all_reduce" mode ``shard`` must be
    that slice's view of ``flat`` (the whole bucket is reduced in place)."""
    if mode == "reduce_scatter":
        return _reduce_scatter(shard, flat, group=group, async_op=True)
    if shard.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        raise ValueError("issue_reduce(mode='all_reduce'): shard must be a view of flat")
    return dist.all_reduce(flat, group=group, async_op=True)


def all_reduce_validation(local: GradStats, present: frozenset[int], checks: Checks,
                          trainable: Sequence[int], group: Any, world_size: int,
                          device: torch.device, label: str) -> GlobalStats:
    """One all-reduce (SUM) of every rank's ``validation_vector`` (runtime/transport.py):
    the global statistics of an iteration. Shared by ZeroTransport and the FSDP2 transport."""
    totals = torch.tensor(validation_vector(local, present, checks, trainable),
                          dtype=torch.float64, device=device)
    with collective_guard(label, group):
        dist.all_reduce(totals, group=group)
    return validation_result(totals.cpu().tolist(), trainable, world_size)


def agree_fingerprint(fingerprint: Mapping[str, Any], group: Any, ranks: list[int]) -> None:
    """All ``ranks`` of ``group`` compare ``fingerprint`` (all_gather_object: sizes may
    differ) and raise the same ``RanksDisagree`` naming the first field that differs."""
    prints: list[Any] = [None] * len(ranks)
    with collective_guard("all_gather_object (rank agreement)", group):
        dist.all_gather_object(prints, dict(fingerprint), group=group)
    diff = first_difference(prints, ranks)
    if diff is not None:
        raise RanksDisagree(
            f"data-parallel ranks disagree: {diff}. Every rank must build the same model "
            "(names, shapes, dtypes, requires_grad), the same OffloadConfig (placement and "
            "thread fields may differ) and the same param groups; fix the launch script so "
            "all ranks run the same configuration")


@dataclass(frozen=True, slots=True)
class ReduceTask:
    """Wait for a bucket's reduce, move the rank's gradient shard to the host buffer, return
    the shard's validation partials (they are disjoint across ranks: their sum is global)."""

    bucket: int
    iteration: int
    work: Any
    """The async collective's handle (torch.distributed Work)."""
    shard_device: torch.Tensor
    grad_host: torch.Tensor
    backend: Backend
    recorder: Recorder

    def run(self) -> GradStats | PendingStats:
        # host clock: the span covers the wait for the collective (on NCCL's own stream) too
        with self.recorder.span(LANE_D2H, KIND_D2H, iteration=self.iteration, bucket=self.bucket,
                                nbytes=self.grad_host.numel() * self.grad_host.element_size()):
            with collective_guard(f"reduce of bucket {self.bucket}"):
                self.work.wait()
            # On CUDA, wait() orders this thread's current stream after the collective; the
            # ready token recorded now orders the D2H copy after it.
            return self.backend.d2h([self.shard_device], [self.grad_host],
                                    self.backend.ready_token())


@dataclass(frozen=True, slots=True)
class GatherTask:
    """All-gather a bucket's updated weight shards and publish them into the parameters.

    Runs whether or not this rank's own step ran (``after`` resolved False when its shard
    was non-finite): an all-gather is collective, every rank must join it."""

    bucket: int
    iteration: int
    after: Future[Any] | None
    src_host: torch.Tensor
    """This rank's updated shard on the host (the kernel's bf16 copy, or the fp32 master)."""
    shard_device: torch.Tensor
    """Device staging of the shard (on the CPU backend: ``src_host`` itself)."""
    flat_device: torch.Tensor
    """The bucket's padded weight buffer on the device."""
    flat_views: tuple[torch.Tensor, ...]
    """Each parameter's slice of ``flat_device``, shaped like the parameter."""
    dst: tuple[torch.Tensor, ...]
    """Where each of ``flat_views`` goes: ``param.data``, or under weight-flow the
    parameter's host home (zero_flow.py)."""
    group: Any
    stream: Any
    """A CUDA stream for the copies and the collective, or None on the CPU."""
    recorder: Recorder
    watchdog_s: float

    def run(self) -> Any:
        if self.after is not None:
            wait_for(self.after, self.watchdog_s, f"CPU step of bucket {self.bucket}")
        nbytes = self.flat_device.numel() * self.flat_device.element_size()
        with self.recorder.span(LANE_H2D, KIND_H2D, iteration=self.iteration,
                                bucket=self.bucket, nbytes=nbytes), torch.no_grad():
            if self.stream is None:
                with collective_guard(f"all_gather of bucket {self.bucket}", self.group):
                    all_gather_flat(self.flat_device, self.shard_device, group=self.group)
                for view, d in zip(self.flat_views, self.dst):
                    d.copy_(view)
                return None
            with torch.cuda.stream(self.stream):
                self.shard_device.copy_(self.src_host, non_blocking=True)
                with collective_guard(f"all_gather of bucket {self.bucket}", self.group):
                    all_gather_flat(self.flat_device, self.shard_device, group=self.group,
                                async_op=True).wait()
                for view, d in zip(self.flat_views, self.dst):
                    d.copy_(view, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # a waiter sleeps, never spins
                done.record(self.stream)
            if any(d.device.type == "cpu" for d in self.dst):
                # weight-flow homes on the host (zero_flow.py): a fetch reads them as soon as
                # this task's future resolves, so the copy down must have landed by then
                done.synchronize()
            return done
