"""The OpenMP wait policy of the process (issue 11 §4). Imports nothing heavy: it must run
before torch is imported.

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

So, when ``superoffload`` is imported before torch and the user set neither variable, we
set ``OMP_WAIT_POLICY=PASSIVE`` for the process (``python -m superoffload`` always does);
a user's own setting always wins (``OMP_WAIT_POLICY=ACTIVE`` opts out).

When torch was imported first (issue 20 §6) the policy can no longer be set, and OpenMP has
no routine that sets it (the wait-policy ICV has none). But libgomp throttles spinning by
its documented rule: "If there are more OpenMP threads than available CPUs, 1000 and 100
spins are used for OMP_WAIT_POLICY being ACTIVE or undefined" (libgomp manual,
GOMP_SPINCOUNT). Its count of threads includes every pool's, and a pool lives as long as
the thread that started it. So ``throttle_spinning`` parks one pool of ``os.cpu_count() + 1``
threads (one kernel call from a thread that then waits forever): from then on every wait
in the process, torch's pools included, spins at most 100 times before it sleeps (a few
microseconds instead of ~300,000 spins). The parked threads sleep on a futex; they cost
their stacks' touched pages. ``SUPEROFFLOAD_OMP_THROTTLE=0`` opts out, and so does any
user setting of ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``. Measured in docs/kernel.md.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
OUR_POLICY = "PASSIVE"
THROTTLE_ENV = "SUPEROFFLOAD_OMP_THROTTLE"
THROTTLED_SPINS = 100  # libgomp's throttled spin count when the policy is undefined


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """What the process's OpenMP runtime was started with."""

    value: str
    """The OMP_WAIT_POLICY / GOMP_SPINCOUNT in force ("default" when neither was set), or
    the throttle ("libgomp throttled: ...") when torch came first."""
    source: str
    """"superoffload" (we set it before torch loaded, or parked a pool to throttle
    spinning after), "user" (the environment), or "default" (neither: torch came first and
    the throttle was refused or is unavailable)."""


_chosen: WaitPolicy | None = None


def choose_wait_policy() -> WaitPolicy:
    """Called once, first thing in ``superoffload.kernels``: set a passive policy if torch
    (which loads libgomp) is not imported yet and the user chose nothing."""
    global _chosen
    if _chosen is None:
        user = {k: os.environ[k] for k in WAIT_ENV if k in os.environ}
        if user:
            _chosen = WaitPolicy(", ".join(f"{k}={v}" for k, v in user.items()), "user")
        elif "torch" in sys.modules:
            _chosen = WaitPolicy("default", "default")
        else:
            os.environ["OMP_WAIT_POLICY"] = OUR_POLICY
            _chosen = WaitPolicy(f"OMP_WAIT_POLICY={OUR_POLICY}", "superoffload")
    return _chosen


def throttle_spinning(park: Callable[[int], None]) -> WaitPolicy:
    """When torch came first and the user chose nothing: park a pool of
    ``os.cpu_count() + 1`` OpenMP threads so libgomp throttles every wait to 100 spins
    (module docstring). ``park(threads)`` runs one parallel region of that many threads on
    the calling thread (a kernel call); it is called from a daemon thread that then waits
    forever, so its pool is never freed. Any other case: the policy unchanged."""
    global _chosen
    policy = choose_wait_policy()
    library = openmp_library()
    if (policy.source != "default" or os.environ.get(THROTTLE_ENV, "").strip() == "0"
            or library is None or "libgomp" not in os.path.basename(library)):
        return policy
    threads = (os.cpu_count() or 1) + 1
    parked, failure = threading.Event(), []

    def parker() -> None:
        try:
            park(threads)
        except Exception as exc:  # a refused call: keep the default policy, say why
            failure.append(exc)
        parked.set()
        if not failure:
            threading.Event().wait()  # the pool belongs to this thread: keep it alive

    threading.Thread(target=parker, name="superoffload-omp-throttle", daemon=True).start()
    parked.wait()
    if failure:
        warnings.warn(f"superoffload could not throttle libgomp's spinning ({failure[0]}); "
                      "set OMP_WAIT_POLICY=PASSIVE in the environment instead", RuntimeWarning,
                      stacklevel=2)
    else:
        _chosen = WaitPolicy(f"libgomp throttled: <= {THROTTLED_SPINS} spins per wait "
                             f"({threads} threads parked)", "superoffload")
    return wait_policy()


def wait_policy() -> WaitPolicy:
    """The policy the process's OpenMP runtime runs with (see the module docstring)."""
    return choose_wait_policy()


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
