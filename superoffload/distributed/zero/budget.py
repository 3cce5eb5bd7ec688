"""Per-rank host resources when several data-parallel ranks share one host (issue 7).

On a Superchip node every GPU has its own Grace CPU, but a PCIe host (or this CPU CI) runs
several ranks on one operating system: they split its cores and its memory. The cores are
split by the one thread rule (``superoffload.threads.optimizer_threads`` with the local rank
count, applied by ``plan.schedule``). The memory:

* Before allocating, every rank checks that local ranks * its host bytes fit in the memory
  the OS reports as available (psutil when installed, else ``MemAvailable`` of
  /proc/meminfo) times a headroom; otherwise it raises ``HostMemoryError`` naming the
  numbers and the fixes, instead of letting the OOM killer take a rank mid-step.
"""

from __future__ import annotations

from dataclasses import dataclass

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
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
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
    per_elem = 4 + moment_bytes + grad_bytes + lp_bytes + (12 if snapshot else 0)
    return shard_numel * per_elem
