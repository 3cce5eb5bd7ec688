"""Per-rank host resources when several data-parallel ranks share one host.

A PCIe host (or this CPU CI) runs several ranks on one operating system: they split its cores
(the thread rule, ``superoffload.threads.optimizer_threads`` with the local rank count) and
its memory: before allocating, every rank checks that local ranks x its host bytes fit in the
available memory (psutil, else /proc/meminfo) times a headroom, and all raise
``HostMemoryError`` naming the numbers and the fixes, instead of the OOM killer taking one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.process_group import collective_guard

DEFAULT_HEADROOM = 0.85
"""Fraction of the available memory the ranks may plan to use (page cache, the model's own
tensors, the Python heap and CUDA's pinned staging need the rest)."""


class HostMemoryError(MemoryError):
    """The ranks on this host would need more host memory than is available."""


def available_host_bytes() -> int:
    """Memory the OS can give new allocations now without swapping."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    with open("/proc/meminfo") as f:
        for line in f:
            # MemAvailable, not MemFree: the kernel's estimate counts reclaimable page cache
            if line.startswith("MemAvailable:"):
                # the file counts kB
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the available host memory: install psutil")


@dataclass(frozen=True, slots=True)
class HostBudget:
    """What one rank plans to hold on the host, and what the host has."""

    rank_bytes: int
    """Host bytes of this rank's shards (master, moments, gradient, copies, snapshot)."""
    local_world_size: int
    available_bytes: int
    headroom: float = DEFAULT_HEADROOM

    @property
    def needed_bytes(self) -> int:
        return self.rank_bytes * self.local_world_size

    @property
    def allowed_bytes(self) -> int:
        # int(): the check compares whole bytes, rounding the headroom's share down
        return int(self.available_bytes * self.headroom)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.allowed_bytes

    def explain(self) -> str:
        return (f"{self.local_world_size} rank(s) on this host x {_size(self.rank_bytes)} of "
                f"offloaded state each = {_size(self.needed_bytes)}, but only "
                f"{_size(self.allowed_bytes)} may be used ({self.headroom:.0%} of "
                f"{_size(self.available_bytes)} available)")


def _size(nbytes: int) -> str:
    """Bytes for people: "12.5 MiB", "3.20 GiB"."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes:,} B"


def budget_message(budget: HostBudget, where: str = "this host") -> str:
    return (f"host memory budget exceeded on {where}: {budget.explain()}. Fixes: fewer ranks "
            "per host (--nproc-per-node), more ranks in total (each holds 1/N of the state), "
            "rollback='inverse' instead of 'snapshot' (saves 12 B/param), or a smaller "
            "OffloadConfig.ratio (more GPU tail buckets, whose state stays on the device)")


def check_host_budget(budget: HostBudget) -> None:
    """Raise HostMemoryError, before anything is allocated, when the ranks would not fit."""
    if not budget.fits:
        raise HostMemoryError(budget_message(budget))


def shard_host_bytes(shard_numel: int, *, grad_bytes: int, lp_bytes: int, snapshot: bool,
                     moment_bytes: int = 8) -> int:
    """Host bytes of one rank's shard of one bucket: fp32 master (4 B) + both moments
    (``moment_bytes``: 8 fp32, 4 bf16), the gradient shard (``grad_bytes`` per element), the
    low-precision weight shard (``lp_bytes``, 0 for an fp32 model) and the optional
    snapshot (12 B)."""
    # the snapshot copies p, m and v in fp32 (runtime/steps.py, rollback="snapshot")
    per_elem = 4 + moment_bytes + grad_bytes + lp_bytes + (12 if snapshot else 0)
    return shard_numel * per_elem


def plan_host_bytes(buckets: Sequence[Sequence[int]], *, dtype: torch.dtype, snapshot: bool,
                    moments: torch.dtype, local_ranks: int, available: int | None = None,
                    headroom: float | None = None, planned: int | None = None) -> HostBudget:
    """This rank's host budget: ``buckets`` lists the local element count of each parameter
    of each offloaded bucket (this rank's shards); gradients land in fp32 host buffers.
    ``planned``: the host bytes plan/storage.py gives a rank with a storage tier or a budget
    (the pool and the resident buckets: what it allocates, not the whole state)."""
    # an fp32 model's master is its weight: no separate low-precision copy on the host
    lp_bytes = 0 if dtype == torch.float32 else dtype.itemsize
    if planned is not None:
        # a tier or a budget allocates the pool and the resident buckets, not the whole state
        rank_bytes = planned
    else:
        # gradients land in fp32 host buffers (4 B); two moments of ``moments`` each
        rank_bytes = sum(
            shard_host_bytes(sum(b), grad_bytes=4, lp_bytes=lp_bytes, snapshot=snapshot,
                             moment_bytes=2 * moments.itemsize) for b in buckets)
    # read only when not given: tests pass a fixed figure
    if available is None:
        available = available_host_bytes()
    return HostBudget(rank_bytes, local_ranks, available,
                      DEFAULT_HEADROOM if headroom is None else headroom)


def count_local_ranks(group: Any) -> int:
    """Ranks of ``group`` on this host (torchrun's LOCAL_WORLD_SIZE when set, else a gather
    of host names): they split this host's cores (the thread rule) and memory."""
    # torchrun's own count needs no collective
    if "LOCAL_WORLD_SIZE" in os.environ:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    hosts: list[object] = [None] * dist.get_world_size(group)
    with collective_guard("all_gather_object (host names)", group):
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return max(1, hosts.count(socket.gethostname()))


def agree_host_budget(budget: HostBudget, group: Any, rank: int) -> None:
    """Raise HostMemoryError on every rank when any rank's host budget does not fit: either
    all ranks allocate or all raise, and none waits in a collective for a peer that gave up."""
    bad = torch.tensor([0.0 if budget.fits else 1.0])
    # NCCL reduces device tensors only
    if dist.get_backend(group) == "nccl":
        bad = bad.cuda()
    # MAX: one rank that does not fit stops them all
    with collective_guard("all_reduce (host budget)", group):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item() > 0:
        where = "another rank's host"
        if not budget.fits:
            where = "this host"
        raise HostMemoryError(f"rank {rank}: {budget_message(budget, where)}")
