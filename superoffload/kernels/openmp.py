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
a user's own setting always wins (``OMP_WAIT_POLICY=ACTIVE`` opts out). When torch was
imported first we cannot change it: ``wait_policy()`` says so, and docs/kernel.md tells how
to set it in the environment.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
OUR_POLICY = "PASSIVE"


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """What the process's OpenMP runtime was started with."""

    value: str
    """The OMP_WAIT_POLICY / GOMP_SPINCOUNT in force ("default" when neither was set)."""
    source: str
    """"superoffload" (we set it before torch loaded), "user" (the environment), or
    "default" (neither, and torch was imported before superoffload)."""


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
