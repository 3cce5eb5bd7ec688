"""What one iteration reads once: the frozen iteration.

Every task of an iteration (a bucket's gradient move, its speculative step, its publish, the
validation, the rollbacks and replays) works with the same settings, read once in the
training thread when the iteration begins and handed to each phase: nothing on the way
reaches back into the engine for them. What may change between iterations changes only at
their boundary (``engine.reconfigure`` and a weight policy switch apply before the first
micro-step; the loss scale changes when the iteration closes; an LR scheduler's change of
``param_groups`` is read at the last micro-step, torch's semantics), so each value read once is
the one a live read would have found. docs/engine.md, "Reading one step".
"""

from __future__ import annotations

from dataclasses import dataclass

from superoffload.config import OffloadConfig
from superoffload.kernels.hyper import AdamHyper


@dataclass(frozen=True, slots=True)
class FrozenIteration:
    """An iteration's inputs (built by the engine: ``OffloadEngine._freeze``)."""

    number: int
    """The iteration these values were read for (tasks and telemetry carry it)."""
    config: OffloadConfig
    """The configuration in force (watchdog, clipping, rollback mode, step order, seed...)."""
    streamed: frozenset[int]
    """Parameter indices weight-flow streams (empty under weight-stationary)."""
    loss_scale: float
    """The loss scale the iteration's gradients carry (fp16; 1.0 otherwise)."""
    threads: int
    """The CPU optimizer's threads (``Schedule.threads``), for every kernel call."""
    speculate: bool
    """Host buckets step before validation (adaptive STV's switch when the iteration began)."""
    accum_on_host: bool
    """Every micro-step's gradients leave and are summed on the host (the engine's resolved
    ``grad_accum_on``; a plain ``loss.backward()`` loop sums in ``.grad``)."""
    hypers: tuple[AdamHyper, ...] = ()
    """Per param group, read at the last micro-step (empty before it)."""
