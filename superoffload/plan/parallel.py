"""Data parallel in the planner: ring collectives, the collective backend, and one rank's
share of a host.

Data parallel runs on FSDP2 (``FsdpOffloadEngine``, distributed/fsdp/; its units:
plan/fsdp_units.py; its iteration: plan/sim_fsdp.py). With N = ModelShape.dp shard ranks
every rank holds 1/N of the weights, gradients and optimizer state; per unit FSDP2
all-gathers the weights before the unit's forward and reduce-scatters its gradients after its
backward, and the engine moves and steps this rank's shard of every bucket (D2H, CPU Adam,
H2D of numel / N). HSDP (ModelShape.dp_replicate = R > 1) all-reduces each reduced shard
across the R replicas; the validation is one small all-reduce over all N x R ranks.
Ring collective over N ranks (Patarasuk & Yuan 2009; NCCL's "bus bandwidth" convention):
  reduce-scatter / all-gather  t = (N - 1) * latency + (N - 1) / N * bytes / bw
  all-reduce                   t = 2 * (N - 1) * latency + 2 * (N - 1) / N * bytes / bw
`bytes` is the whole buffer, bw = HardwareProfile.collective_gbps; N = 1 costs 0.
The backend follows the device (``collective_backend``): gloo on a CPU device, whose
collectives run synchronously in the training thread; NCCL on a GPU, on its own streams.
Ranks on one host (ModelShape.ranks_per_host = R) split its cores, memory, memory bandwidth,
host cast rate and storage tier evenly (the engine's thread rule, superoffload/threads.py:
threads = cores * frac / R); so do the jobs of the GPUs that share a host
(HardwareProfile.gpus_per_host: one GPU of an 8-GPU server trains on an eighth of it, DESIGN.md
§7); the link to the device is per GPU and not split.
"""

from __future__ import annotations

import math

import numpy as np

from superoffload.plan.hardware import HardwareProfile


def _check_ranks(ranks: int) -> None:
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: use a whole number >= 1 (the data-parallel size)")


def ring_time_s(nbytes: float | np.ndarray, ranks: int, prof: HardwareProfile,
                steps_factor: int = 1) -> np.ndarray:
    """Seconds of a ring reduce-scatter or all-gather (steps_factor=2: all-reduce) of a buffer
    of `nbytes` over `ranks` ranks, per rank; 0 for one rank or an empty buffer."""
    _check_ranks(ranks)
    nb = np.asarray(nbytes, dtype=float)
    if ranks == 1:
        return np.zeros_like(nb)
    k = steps_factor * (ranks - 1)
    t = k * prof.collective_latency_s + k / ranks * nb / (prof.collective_gbps * 1e9)
    return np.where(nb > 0, t, 0.0)


def reduce_scatter_time_s(nbytes: float, ranks: int, prof: HardwareProfile) -> float:
    """Ring reduce-scatter of `nbytes` (the whole buffer) over `ranks` ranks."""
    return float(ring_time_s(nbytes, ranks, prof))


def all_gather_time_s(nbytes: float, ranks: int, prof: HardwareProfile) -> float:
    """Ring all-gather producing `nbytes` (the whole buffer) on each of `ranks` ranks."""
    return float(ring_time_s(nbytes, ranks, prof))


def all_reduce_time_s(nbytes: float, ranks: int, prof: HardwareProfile) -> float:
    """Ring all-reduce (reduce-scatter + all-gather) of `nbytes` over `ranks` ranks."""
    return float(ring_time_s(nbytes, ranks, prof, steps_factor=2))


DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""The collective backend of a device type (``init_distributed``'s default per device)."""


def collective_backend(prof: HardwareProfile) -> str:
    """"gloo" (a CPU device: each collective blocks the training thread) or "nccl" (a GPU:
    collectives overlap compute on their own streams), from ``prof.device_type``."""
    return DIST_BACKENDS[prof.device_type]


def host_share(prof: HardwareProfile, ranks_per_host: int = 1) -> int:
    """How many ways the host is split for one rank: its ranks on the host, or the GPUs
    whose jobs share the host (``HardwareProfile.gpus_per_host``), whichever is more -- one
    GPU of an 8-GPU server gets an eighth of it even when it trains alone."""
    _check_ranks(ranks_per_host)
    return max(ranks_per_host, prof.gpus_per_host)


def rank_profile(prof: HardwareProfile, ranks_per_host: int) -> HardwareProfile:
    """What one rank sees of its host, split ``host_share`` ways (S): 1/S of the host's cores
    (at least one), memory, memory bandwidth, host cast rate and storage tier (rates,
    capacity, queue depth); measured CPU Adam rates are capped at 1/S of the measured
    saturation. On a shared-memory machine the device pool is split too. The result is
    that share (``gpus_per_host`` 1), so splitting it again with one rank per host changes
    nothing. S = 1 returns `prof` itself (dp=1 predictions on a host of its own unchanged)."""
    r = host_share(prof, ranks_per_host)
    if r == 1:
        return prof
    changes: dict = {
        "name": prof.name,
        "cpu_cores": max(1, prof.cpu_cores // r),
        "host_memory_bytes": prof.host_memory_bytes / r,
        "host_mem_bw_gbps": prof.host_mem_bw_gbps / r,
        "host_cast_gelems": prof.host_cast_gelems / r,
        "storage_read_gbps": prof.storage_read_gbps / r,
        "storage_write_gbps": prof.storage_write_gbps / r,
        "storage_bytes": prof.storage_bytes / r,
        # ranks share the drives' queue; at least one request each (none without a tier)
        "storage_queue_depth": max(1, prof.storage_queue_depth // r) if prof.has_storage
        else 0,
        "gpus_per_host": 1,
    }
    if prof.cpu_adam_table:
        # r ranks step at once on one bus: each gets at most 1/r of the measured peak
        cap = max(rate for _, rate in prof.cpu_adam_table) / r
        changes["cpu_adam_table"] = tuple((t, min(rate, cap)) for t, rate in prof.cpu_adam_table)
    if prof.shared_memory:
        changes["device_memory_bytes"] = prof.device_memory_bytes / r
    return prof.replace(**changes)


def hosts(dp: int, ranks_per_host: int) -> int:
    """Hosts a run of `dp` ranks, `ranks_per_host` per host, occupies."""
    _check_ranks(dp)
    _check_ranks(ranks_per_host)
    return math.ceil(dp / ranks_per_host)
