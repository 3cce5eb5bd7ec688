"""The OpenMP wait policy of a process superoffload owns: ``python -m superoffload``.

A library does not write its user's environment, so ``import superoffload`` leaves it
alone (the kernel throttles libgomp's spinning at its first call instead:
kernels/openmp.py). The CLI owns its process, so before it imports torch (libgomp reads
``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, at ``import torch``) it asks for a passive
policy: waiting OpenMP threads sleep instead of spinning on a CPU another thread needs
(measured in docs/kernel.md, "Threads, the work split and the OpenMP wait policy"). A
user's own setting of either variable always wins. Imports nothing heavy: it runs before
torch.
"""

from __future__ import annotations

import os
import sys

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""The variables libgomp reads for its wait policy; a user who sets either chose it."""
OUR_POLICY = "PASSIVE"

_set_here = False


def claim_wait_policy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process (and the processes it starts) when
    torch is not imported yet and the user set neither variable; True when it did."""
    global _set_here
    if not _set_here and "torch" not in sys.modules and not user_wait_policy():
        os.environ["OMP_WAIT_POLICY"] = OUR_POLICY
        _set_here = True
    return _set_here


def passive_set_here() -> bool:
    """Whether ``claim_wait_policy`` set the policy in this process."""
    return _set_here


def user_wait_policy() -> dict[str, str]:
    """The wait-policy variables the user set (not the one ``claim_wait_policy`` wrote)."""
    return {k: os.environ[k] for k in WAIT_ENV
            if k in os.environ and not (_set_here and k == "OMP_WAIT_POLICY")}
