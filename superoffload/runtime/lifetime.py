"""Releasing an engine's threads and hooks, also when it is dropped without ``close()``.

An engine registers hooks on the model and starts lane threads. If it were only released by
``close()``, a dropped (or failed and abandoned) engine would keep its threads and hooks
alive for as long as the model lives, and every later forward would run them. So the hooks
hold only weak references (runtime/hooks.py) and ``weakref.finalize(engine, release, ...)``
stops the lanes and removes the hooks when the engine is closed or garbage-collected. The
arguments below must never reference the engine itself (that would keep it alive).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from superoffload.runtime.worker import Lane

CLOSE_TIMEOUT_S = 5.0
"""How long release waits for the lane threads to finish its queued tasks; a lane stuck in a
collective or a hung copy is a daemon thread and is abandoned after it (never blocks exit)."""


def release(lanes: Sequence[Lane], hooks: list[Any]) -> None:
    """Remove every hook, then stop every lane (idempotent; never raises)."""
    for handle in hooks:
        with contextlib.suppress(Exception):
            handle.remove()
    hooks.clear()
    for lane in lanes:  # all at once, then one shared deadline: a stuck lane costs 5 s once
        with contextlib.suppress(Exception):
            lane.stop()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for lane in lanes:
        with contextlib.suppress(Exception):
            lane.join(max(0.0, deadline - time.monotonic()))
