"""The OpenMP wait policy of the process (docs/kernel.md, "Threads, the work split and the
OpenMP wait policy").

Our kernel is compiled with gcc's ``-fopenmp`` and names ``libgomp.so.1``; torch's wheel
ships its own ``torch/lib/libgomp.so.1`` with the same soname and is always loaded first
(``superoffload.kernels`` imports torch), so the dynamic loader binds our library to
TORCH'S copy: one OpenMP runtime, and one wait policy, for the whole process. libgomp reads
``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, in its constructor, i.e. at ``import
torch``; setting them any later (before loading our .so included) changes nothing.

By default libgomp's idle workers spin ~300,000 times before sleeping, and it throttles
that only when ITS OWN threads outnumber the CPUs. Threads it does not know about (another
process, the engine's transfer and training threads, a second OpenMP pool) are not counted,
so on a busy host a waiting worker spins on a CPU the lagging one needs, and every barrier
costs a scheduler time slice. Measured on the project's 2-core machine while other jobs ran
(docs/kernel.md): a 65,536-element step took 19-25 ms instead of 0.1 ms, and a tiny GPT's
forward+backward 0.3-0.9 s instead of 20 ms. With a passive policy waiting threads sleep.

A library writes no environment variable and starts no thread at import, so the policy is
settled at the kernel's first call (``start_throttle``, called once per process by
kernels/cpu_adam.py). By then torch is loaded and the policy can no longer be set, and
OpenMP has no routine that sets it (the wait-policy ICV has none). But libgomp throttles
spinning by its documented rule: "If there are more OpenMP threads than available CPUs,
1000 and 100 spins are used for OMP_WAIT_POLICY being ACTIVE or undefined" (libgomp
manual, GOMP_SPINCOUNT). Its count of threads includes every pool's, and a pool lives as
long as the thread that started it. So the first call parks one pool of
``os.cpu_count() + 1`` threads (one kernel call from a thread that then waits forever):
from then on every wait in the process, torch's pools included, spins at most 100 times
before it sleeps (a few microseconds instead of ~300,000 spins). The parked threads sleep
on a futex; they cost their stacks' touched pages. ``SUPEROFFLOAD_OMP_THROTTLE=0`` opts
out, and so does any user setting of ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``; under
``python -m superoffload`` the CLI set ``OMP_WAIT_POLICY=PASSIVE`` before torch loaded
(superoffload/process_env.py), so nothing is parked. Measured in docs/kernel.md.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from superoffload.process_env import OUR_POLICY, passive_set_here, user_wait_policy

THROTTLE_ENV = "SUPEROFFLOAD_OMP_THROTTLE"
# libgomp's throttled spin count when the policy is undefined
THROTTLED_SPINS = 100
NOT_STARTED = "not started (the throttle starts at the first kernel call)"


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """What the process's OpenMP runtime runs with."""

    value: str
    """The OMP_WAIT_POLICY / GOMP_SPINCOUNT in force ("default" when neither was set), the
    throttle ("libgomp throttled: ...") once the first kernel call parked a pool, or
    ``NOT_STARTED`` before the first kernel call."""
    source: str
    """"superoffload" (the CLI set the policy before torch loaded, or the first kernel
    call parked a pool to throttle spinning), "user" (the environment), or "default"
    (neither: the throttle was refused, is unavailable, or has not started yet)."""


_chosen: WaitPolicy | None = None
_lock = threading.Lock()


def _without_throttle() -> WaitPolicy | None:
    """The policy when no pool needs parking: the user's, or the CLI's."""
    user = user_wait_policy()
    if user:
        return WaitPolicy(", ".join(f"{k}={v}" for k, v in user.items()), "user")
    if passive_set_here():
        return WaitPolicy(f"OMP_WAIT_POLICY={OUR_POLICY}", "superoffload")
    return None


def start_throttle(park: Callable[[int], None]) -> WaitPolicy:
    """Settle the policy, once per process (the kernel's first call): unless the user or
    the CLI chose one, park a pool of ``os.cpu_count() + 1`` OpenMP threads so libgomp
    throttles every wait to 100 spins (module docstring). ``park(threads)`` runs one
    parallel region of that many threads on the calling thread (a kernel call); it is
    called from a daemon thread that then waits forever, so its pool is never freed. The
    caller must not call back here from ``park`` (kernels/cpu_adam.py sets its flag first)."""
    global _chosen
    with _lock:
        if _chosen is None:
            _chosen = _settle(park)
        return _chosen


def _settle(park: Callable[[int], None]) -> WaitPolicy:
    chosen = _without_throttle()
    if chosen is not None:
        return chosen
    library = openmp_library()
    if (os.environ.get(THROTTLE_ENV, "").strip() == "0"
            or library is None or "libgomp" not in os.path.basename(library)):
        return WaitPolicy("default", "default")
    threads = (os.cpu_count() or 1) + 1
    parked, failure = threading.Event(), []

    def parker() -> None:
        try:
            park(threads)
        except Exception as exc:
            # a refused call: keep the default policy, say why
            failure.append(exc)
        parked.set()
        if not failure:
            # the pool belongs to this thread: keep it alive
            threading.Event().wait()

    threading.Thread(target=parker, name="superoffload-omp-throttle", daemon=True).start()
    parked.wait()
    if failure:
        warnings.warn(f"superoffload could not throttle libgomp's spinning ({failure[0]}); "
                      "set OMP_WAIT_POLICY=PASSIVE in the environment instead", RuntimeWarning,
                      stacklevel=4)
        return WaitPolicy("default", "default")
    return WaitPolicy(f"libgomp throttled: <= {THROTTLED_SPINS} spins per wait "
                      f"({threads} threads parked)", "superoffload")


def wait_policy() -> WaitPolicy:
    """The policy the process's OpenMP runtime runs with (see the module docstring);
    ``NOT_STARTED`` before the first kernel call when neither the user nor the CLI chose."""
    if _chosen is not None:
        return _chosen
    return _without_throttle() or WaitPolicy(NOT_STARTED, "default")


def openmp_library() -> str | None:
    """Path of the libgomp mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libgomp" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None
