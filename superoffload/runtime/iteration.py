"""The iteration's books and the parts it runs on: the counters (``EngineStats``), a bucket in
flight (``Flight``), the iteration in progress (``Iteration``), and ``Parts``, the long-lived
collaborators every phase of the step is handed (runtime/launch.py, runtime/stv.py). The
training thread owns the books; lanes only add to the counters."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from superoffload.runtime.auto_rollback import Rescue
from superoffload.runtime.contract import Contract
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import Lane
from superoffload.runtime.publishes import Publishes
from superoffload.runtime.skips import Cause
from superoffload.runtime.steps import KernelCall, priority
from superoffload.runtime.transfers import InFlight
from superoffload.runtime.transport import GlobalStats, Transport
from superoffload.telemetry.recorder import Recorder

__all__ = ["EngineStats", "Flight", "Iteration", "Parts"]


@dataclass(slots=True)
class EngineStats:
    """Counters of what happened (bucket counts are per bucket, not per iteration)."""

    iterations: int = 0
    skipped_steps: int = 0
    clipped_steps: int = 0
    rollbacks: int = 0
    """Speculative bucket steps undone."""
    replays: int = 0
    """Bucket steps replayed with the clipped gradient."""
    speculated_buckets: int = 0
    """Speculative bucket steps that ran."""
    nonfinite_buckets: int = 0
    """Buckets whose own gradient was non-finite (never speculated)."""
    guarded_elements: int = 0
    """``rollback="auto"``: elements whose pre-step values a speculative step kept because
    the inverse's error bound did not hold for them (runtime/auto_rollback.py)."""
    speculation_enabled: bool = True
    reconfigurations: int = 0
    skip_streak: int = 0
    """Steps skipped in a row for a reason fp16's loss scale does not explain (0 after a step
    that ran; runtime/skips.py says so when it reaches ``SKIP_STREAK``)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]

    def counter(self, name: str, *, when: Future[Any] | None = None
                ) -> Callable[[Future[Any]], None]:
        """A done-callback adding 1 to ``<name>`` when the task ran (returned True, or a
        step's Rescue) and, with ``when`` (done before the task ran), that one ran too."""
        def done(fut: Future[Any]) -> None:
            if when is not None and not (when.exception() is None and bool(when.result())):
                return
            if fut.exception() is None and bool(fut.result()):
                with _COUNTING:
                    setattr(self, name, getattr(self, name) + 1)
        return done

    def count_rescue(self, fut: Future[Any]) -> None:
        """Done-callback of a speculative step: the elements a ``Rescue`` kept
        (``rollback="auto"``)."""
        if fut.exception() is None and isinstance(fut.result(), Rescue):
            with _COUNTING:
                self.guarded_elements += fut.result().elements


_COUNTING = threading.Lock()
"""Counters are added to on the lanes' threads (done-callbacks); never held while launching."""


@dataclass(slots=True)
class Flight:
    """A bucket in flight during one iteration."""

    bucket: int
    on_device: bool
    present: frozenset[int]
    """Its parameters with a local gradient at launch."""
    calls: tuple[KernelCall, ...]
    """Kernel calls over this rank's positions of those parameters."""
    stats: Future[Any] | None = None
    """Host buckets: the local validation statistics (D2H or reduce)."""
    spec: Future[Any] | None = None
    """The speculative step (resolves True when it ran)."""
    spec_scale: float = 1.0


@dataclass(slots=True)
class Iteration:
    """Bookkeeping of the iteration in progress (training thread)."""

    frozen: FrozenIteration
    """What the iteration reads once (runtime/frozen.py): set when its first micro-step
    begins, its hyper-parameters added at the last; until then the previous iteration's
    (what a forward before the first backward waits with)."""
    micro_step: int = 0
    armed: bool = False
    """The last micro-step of the accumulation: buckets launch as they complete."""
    fired: dict[int, set[int]] = field(default_factory=dict)
    """Per bucket, its parameters whose gradient is final in the last micro-step."""
    moved: dict[int, set[int]] = field(default_factory=dict)
    """Host accumulation, an earlier micro-step: per bucket, the parameters whose gradient
    of this micro-step is final (the bucket leaves when all have)."""
    plain: dict[int, int] = field(default_factory=dict)
    """Per parameter, post-accumulate-grad hooks seen outside ``engine.backward`` (plain
    ``loss.backward()``): their maximum is the number of backward passes since the last
    step, the micro-steps of that loop."""
    ready: set[int] = field(default_factory=set)
    next_launch: int = 0
    flights: dict[int, Flight] = field(default_factory=dict)
    losses: list[Any] = field(default_factory=list)
    """Loss tensors (detached); read as floats when the iteration closes (no host sync in
    backward)."""
    settling: bool = False
    """``step()`` has begun acting on the verdict (rollbacks, replays, the tail step)."""
    clip_norm: float | None = None
    """``engine.clip_grad_norm_(max_norm)`` of this iteration (the smaller threshold wins)."""
    validated: GlobalStats | None = None
    """The global statistics, when ``clip_grad_norm_`` validated before ``step()``."""
    skip_causes: list[Cause] = field(default_factory=list)
    """The buckets that made this rank's validation non-finite, and why (runtime/skips.py)."""


@dataclass(frozen=True, slots=True)
class Parts:
    """The long-lived collaborators of one engine's iteration core, built once by the engine
    and handed to every phase (none of them holds the engine)."""

    state: EngineState
    transport: Transport
    contract: Contract
    cpu_worker: Lane
    """The CPU optimizer's lane (``cpu_worker``)."""
    publishes: Publishes
    in_flight: InFlight
    recorder: Recorder
    stats: EngineStats

    def submit(self, task: Any, b: int, frozen: FrozenIteration, *,
               after: Sequence[Future[Any]] = ()) -> Future[Any]:
        """A task of bucket ``b`` on the CPU worker once ``after`` is done, earliest deadline
        first (``steps.priority``); ``synchronize()`` waits for it."""
        return self.in_flight.add(self.cpu_worker.submit(task, after=after,
                                                     priority=priority(b, frozen)))

    def bucket_params(self, b: int) -> tuple[int, ...]:
        """Every parameter of bucket ``b`` (the plan's; an FSDP2 rank steps its shards)."""
        schedule = self.state.schedule
        assert schedule is not None, "the engine builds its buckets before training"
        return schedule.bucket_plan.buckets[b].param_indices
