"""Bookkeeping types of the iteration core (runtime/scheduler.py, settle.py): the counters, a
bucket in flight, the iteration in progress. The training thread owns them."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from superoffload.kernels import AdamHyper
from superoffload.runtime.steps import KernelCall
from superoffload.runtime.transport import GlobalStats

__all__ = ["EngineStats", "Flight", "Iteration"]


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
    the inverse's error bound did not hold for them (runtime/rollback_guard.py)."""
    speculation_enabled: bool = True
    reconfigurations: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


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

    micro_step: int = 0
    armed: bool = False
    """The last micro-step of the accumulation: buckets launch as they complete."""
    speculate: bool = False
    hypers: list[AdamHyper] = field(default_factory=list)
    """Per param group, read when the iteration's last micro-step began."""
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
