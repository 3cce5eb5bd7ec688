"""Releasing an engine's threads and hooks, also when it is dropped without ``close()``.

An engine registers hooks on the model and starts lane threads. If it were only released by
``close()``, a dropped (or failed and abandoned) engine would keep its threads and hooks
alive for as long as the model lives, and every later forward would run them. So the hooks
hold only weak references (runtime/hook_base.py) and ``weakref.finalize(engine, stop_lanes, ...)``
stops the lanes and removes the hooks when the engine is closed or garbage-collected. The
arguments below must never reference the engine itself (that would keep it alive).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from superoffload.runtime.lanes import Barrier, Lane, describe_lane

CLOSE_TIMEOUT_S = 5.0
"""How long ``close()`` waits without progress: ``quiesce`` gives up once no lane has begun or
ended a task for this long, and stop_lanes then waits at most this long for the threads to exit.
A lane stuck in a collective, a hung copy or a hung CPU step is a daemon thread and is
abandoned (never blocks exit); ``close()`` then says which (docs/failure_semantics.md)."""


def quiesce(lanes: Sequence[Lane], quiet_s: float | None = None) -> str | None:
    """Wait until every lane has run what was submitted to it, for as long as work progresses;
    give up once no lane has begun or ended a task for ``quiet_s`` (``CLOSE_TIMEOUT_S``).
    Returns None when every lane is idle, else what is stuck (and abandons those lanes, so
    the joins of ``stop_lanes`` do not wait for them again). Never raises."""
    quiet = CLOSE_TIMEOUT_S if quiet_s is None else quiet_s
    start = time.monotonic()

    def last_progress() -> float:
        return max([start, *(getattr(lane, "progress_s", start) for lane in lanes)])

    # a round per link of a chain (D2H -> step -> H2D): a few suffice
    for _ in range(64):
        barriers: list[Future[Any]] = []
        for lane in lanes:
            # a closed lane has nothing left to run
            with contextlib.suppress(Exception):
                barriers.append(lane.submit(Barrier()))
        while True:
            left = last_progress() + quiet - time.monotonic()
            _, pending = concurrent.futures.wait(barriers, timeout=max(0.0, left))
            if not pending:
                break
            if time.monotonic() >= last_progress() + quiet:
                stuck = [lane for lane in lanes if getattr(lane, "busy", False)]
                for lane in stuck:
                    lane.abandon()
                return (", ".join(describe_lane(lane) for lane in stuck) or "a lane") + \
                    f": no task began or ended for {quiet:g} s"
        # tasks chained on the futures that just ended were queued after the barriers
        if not any(getattr(lane, "busy", False) for lane in lanes):
            return None
    return None


def stop_lanes(lanes: Sequence[Lane], hooks: list[Any]) -> None:
    """Remove every hook, then stop every lane (idempotent; never raises)."""
    for handle in hooks:
        with contextlib.suppress(Exception):
            handle.remove()
    hooks.clear()
    # all at once, then one shared deadline: a stuck lane costs 5 s once
    for lane in lanes:
        with contextlib.suppress(Exception):
            lane.stop()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for lane in lanes:
        with contextlib.suppress(Exception):
            lane.join(max(0.0, deadline - time.monotonic()))


def shut_down(engine: Any) -> None:
    """Stop ``engine``'s lanes, remove every hook, leave the model holding its latest weights
    (weight-flow: copied back from the homes without the lanes). Idempotent."""
    from superoffload.runtime import contract

    engine.finalizer()
    contract.release_params(engine.trainable_params(), engine)
    flow, engine.weights.flow = engine.weights.flow, None
    if flow is not None:
        flow.restore_in_place()


def close_engine(engine: Any) -> None:
    """``engine.close()``: drain (unless a lane failed or is stuck), stop, release. Cleanup
    always completes; raises only a lane failure no call has reported yet, or a
    ``WatchdogTimeout`` naming a lane that made no progress for ``CLOSE_TIMEOUT_S``."""
    from superoffload.runtime.errors import WatchdogTimeout

    if engine.closed:
        return
    failures = engine.failures
    seen = failures.reported
    # drained only when no lane failed: a failed lane's queued work will not complete
    stuck = None
    if not failures.failed:
        stuck = quiesce(engine.lanes)
    if not failures.failed and stuck is None:
        # a lane's failure is kept: raised below
        with contextlib.suppress(Exception):
            engine.drain()
    engine.closed = True
    shut_down(engine)
    engine.transport.close()
    engine.publishes.pending.clear()
    engine.forget_iteration()
    engine.state.buffers = []
    if failures.failed and not seen:
        failures.raise_if_failed()
    if stuck is not None:
        raise WatchdogTimeout(f"close(): {stuck}; abandoned (buckets not finished keep "
                              "their weights from before the last step)")


def supersede(engine: Any, why: str) -> None:
    """Another engine took ``engine``'s model (runtime/contract.py ``claim_params``): roll back a
    half iteration, close, and say ``why`` on any later call."""
    if engine.closed:
        return
    if engine.launcher.current.micro_step and not engine.failures.failed:
        # a failure is reported by close() below
        with contextlib.suppress(Exception):
            engine.control.abort()
        # its offloaded gradients left with their buckets: drop the rest too, so the new
        # engine starts from no gradient rather than from half of this iteration's
        for p in engine.trainable_params():
            p.grad = None
    engine.closed_why = why
    close_engine(engine)
