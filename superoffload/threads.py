"""The one CPU-thread rule (DESIGN.md §6): how many threads the CPU optimizer gets.

Used by the engine (both transports), the kernels' ``threads=None`` default, the planner
(``plan.schedule``, with a profile's cores) and the tuner. A leaf module: it imports
nothing of ours, so the kernels can use it without importing the planner.
"""

from __future__ import annotations

import math
import os


def usable_cores() -> int:
    """Cores this process may run on: the affinity mask (a container's cpuset, taskset), not
    the machine's core count (``os.cpu_count()`` oversubscribes a 16-CPU container on a
    larger host)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def optimizer_threads(usable: int, cores_frac: float, *, local_ranks: int = 1,
                      reserved: int = 0, explicit: int | None = None) -> int:
    """CPU optimizer (OpenMP) threads of one rank: the one thread rule.

    ``usable`` cores (the affinity mask, or a profile's cores) are split evenly among the
    ``local_ranks`` sharing the host; of a rank's share, ``cores_frac`` (DeepSpeed's
    ``cpuadam_cores_perc``) goes to the optimizer, and never the cores of the runtime's own
    busy threads (``reserved``: the training thread and the transfer threads on a GPU host),
    so the memory-bound OpenMP loop is not preempted (an oversubscribed static OpenMP split
    stretches to its slowest thread). ``explicit`` (``OffloadConfig.cpu_threads``) wins, capped
    at the share. At least 1.
    """
    if usable < 1 or local_ranks < 1 or reserved < 0:
        raise ValueError(f"optimizer_threads(usable={usable}, local_ranks={local_ranks}, "
                         f"reserved={reserved}): use usable, local_ranks >= 1 and reserved >= 0")
    if not 0.0 < cores_frac <= 1.0:
        raise ValueError(f"cores_frac={cores_frac}: use a fraction in (0, 1]")
    share = max(1, usable // local_ranks)
    if explicit is not None:
        return max(1, min(int(explicit), share))
    return max(1, min(math.floor(share * cores_frac), share - reserved))


def runtime_threads(device_type: str) -> int:
    """Busy threads of the runtime besides the optimizer's: on a GPU host the training thread
    (launching kernels) and the transfer lanes' threads; on a CPU-only machine the "device"
    compute shares the cores anyway and ``cores_frac`` alone sets the split."""
    return 2 if device_type == "cuda" else 0
