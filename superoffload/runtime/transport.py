"""The transport seam: how a bucket's gradients leave and its new weights come back.

The iteration core (runtime/launch.py, runtime/stv.py) is one schedule (DESIGN.md §3, paper
§4.2-4.3); what differs between one process and data parallel is only how data moves:

* single process (``LocalTransport``): a host bucket's gradients go device -> host (D2H),
  the CPU steps the whole bucket, the new weights go host -> device (H2D);
* data parallel (``superoffload.distributed.fsdp.FsdpTransport``): FSDP2 reduce-scatters the
  gradients, each rank steps its shards, FSDP2 all-gathers the new weights (paper §4.6).

A transport allocates the buckets (it knows where each piece lives), starts a bucket's
gradient movement and returns the bucket's local validation statistics as a future,
reduces the statistics of all ranks to global ones, publishes a stepped bucket's weights,
and says where weight-flow's host copy of each parameter lives. Both transports hold what
they share rather than inherit it: their buffers (runtime/bucket_store.py) and their two
lanes with the tasks they run (runtime/copy_lanes.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from superoffload.plan.buckets import BucketPlan
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.contract import hashes_agree
from superoffload.runtime.devices import DeviceOps, GradStats
from superoffload.runtime.engine_state import BucketBuffers, EngineState, ParamState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.lanes import ErrorSink, Lane, Priority
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transfers import InFlight
from superoffload.telemetry.recorder import Recorder


@dataclass(frozen=True, slots=True)
class Published:
    """What publishing a bucket's weights started."""

    device: Future[Any] | None
    """Done when the device copy of the weights is current (a module waits on it), or None
    when nothing is copied to the device (weight-flow streams those weights instead)."""
    home: Future[Any] | None
    """Done when the weight-flow host copy ("home") of the bucket is current."""


@dataclass(frozen=True, slots=True)
class GlobalStats:
    """Validation statistics summed over every rank (DESIGN.md §3 step 3)."""

    sum_sq: float
    """Sum of squares of the gradient as the kernel reads it (loss-scaled, summed over ranks)."""
    nonfinite: int
    present: frozenset[int]
    """Trainable parameters with a gradient on some rank (they step; the others are left
    untouched, as torch.optim does with ``grad is None``)."""
    partial: frozenset[int] = frozenset()
    """Of those, the ones some rank had no gradient for (every rank knows which)."""
    edited: int = 0
    """Ranks on which a gradient changed after the engine took it (runtime/contract.py)."""
    agree: bool = True
    """Every rank steps with the same hyper-parameters (the contract's hash, summed)."""


@dataclass(frozen=True, slots=True)
class Checks:
    """What the validation reduce carries besides the statistics (runtime/contract.py): this
    rank's verdict on gradient edits and the hash of its hyper-parameters in force."""

    edited: bool = False
    hyper_hash: tuple[int, int] = (0, 0)


NO_CHECKS = Checks()

_HEAD = 7
"""Validation vector: [sum of squares, non-finite count, edited, h1, h1^2, h2, h2^2]."""


def validation_vector(local: GradStats, present: frozenset[int], checks: Checks,
                      trainable: Sequence[int]) -> list[float]:
    """What a collective transport all-reduces (SUM) to validate an iteration: the local
    statistics, the contract's checks (runtime/contract.py: an edit flag and two 16-bit hyper hashes
    with their squares), then 1 per trainable parameter with a local gradient."""
    h1, h2 = checks.hyper_hash
    values = [local.sum_sq, float(local.nonfinite), float(checks.edited),
              float(h1), float(h1 * h1), float(h2), float(h2 * h2)] + [0.0] * len(trainable)
    slot = {i: _HEAD + k for k, i in enumerate(trainable)}
    for i in present:
        values[slot[i]] = 1.0
    return values


def validation_result(totals: Sequence[float], trainable: Sequence[int],
                      world_size: int) -> GlobalStats:
    """The summed ``validation_vector`` of ``world_size`` ranks as global statistics."""
    counts = totals[_HEAD:]
    got = frozenset(i for i, c in zip(trainable, counts) if c > 0)
    partial = frozenset(i for i, c in zip(trainable, counts) if 0 < c < world_size)
    return GlobalStats(float(totals[0]), int(totals[1]), got, partial, edited=int(totals[2]),
                       agree=hashes_agree([float(x) for x in totals[3:7]], world_size))


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a transport is given when the engine starts."""

    state: EngineState
    device_ops: DeviceOps
    recorder: Recorder
    inline: bool
    on_error: ErrorSink
    in_flight: InFlight
    """The engine's waits (a lane's failure surfaces as the engine's error): a transport that
    waits for a publish outside the engine's own calls (FSDP2's pre-hooks) waits through it."""
    fingerprint: Mapping[str, Any] | None = None
    """What every data-parallel rank must agree on (``contract.fingerprint``): a collective
    transport compares it over its ranks before its first collective."""


class Transport(Protocol):
    name: str
    """"local" or "fsdp"."""
    collective: bool
    """Ranks step together: an iteration interrupted on one rank cannot be undone on that
    rank alone (the others' collectives no longer match), so the engine fails instead of
    rolling it back (``OffloadEngine.backward``/``step``, docs/failure_semantics.md)."""
    ordered_launch: bool
    """Buckets must be launched in bucket order on every rank (collectives match by order)."""
    grad_divisor: int
    """Gradients arrive summed over this many ranks: the kernel's scale carries 1/N."""
    rank: int
    local_ranks: int
    """Ranks sharing this host's cores and memory (the thread rule splits the cores)."""
    accumulates_on_host: bool
    """``launch`` honours ``accumulated=`` and ``final=`` (``OffloadConfig.grad_accum_on=
    "host"``: every micro-step's gradients are summed into the host buffers)."""

    @property
    def tier(self) -> StateTier | None:
        """The storage tier holding some host buckets' state (runtime/tier.py), or None."""
        ...

    def start(self, ctx: TransportContext) -> None:
        """Once, before the first build: lanes, groups, collective set-up."""
        ...

    @property
    def lanes(self) -> tuple[Lane, ...]:
        ...

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool, moments: torch.dtype = torch.float32,
              storage: Storage | None = None) -> list[BucketBuffers]:
        """Allocate every bucket of ``plan`` from full per-parameter ``states`` (each rank
        keeping its part); returns, per bucket id, the buffers the optimizer steps.
        ``moments``: the host buckets' moment dtype (``optimizer_state_dtype``); ``storage``:
        the storage tier and the host memory budget (runtime/tier_open.py), or None."""
        ...

    def launch(self, b: int, present: tuple[int, ...], frozen: FrozenIteration, *,
               accumulated: frozenset[int] | None = None,
               final: bool = True) -> Future[Any] | None:
        """A bucket's gradients are final: start moving them. Returns the local validation
        statistics of what this rank will step (host buckets), None for tail buckets.
        ``frozen``: the iteration's settings (its number, weight-flow's streamed parameters).
        The caller frees the device gradients once this returns (runtime/departures.py): the
        transport's task must hold what it still reads. With ``accumulates_on_host``:
        ``accumulated`` (parameters whose host buffer already holds a partial sum: add into it,
        copy elsewhere; None: a plain move) and ``final`` (False: an earlier micro-step, no
        statistics wanted)."""
        ...

    def full_grad(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s whole gradient as the optimizer will read it (loss-scaled,
        summed over micro-steps and ranks), once its move has landed; None without one."""
        ...

    def tail_stats(self, buckets: Sequence[int]) -> GradStats:
        """Local statistics of the tail buckets' gradients (counted once over the ranks)."""
        ...

    def tail_grads(self, b: int) -> list[torch.Tensor]:
        """The gradient a tail bucket steps with, per position of its buffers."""
        ...

    def discard(self, buckets: Sequence[int]) -> None:
        """Forget the launched tail buckets of an iteration that will not finish (ZeRO: wait
        for their all-reduce, which every rank issued)."""
        ...

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        """Sum the statistics (and the parameters with gradients, and ``checks``) over the
        ranks."""
        ...

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        """Every rank holds the same ``fingerprint`` (raise ``RanksDisagree`` naming the first
        field that differs, on every rank); one process: nothing to compare."""
        ...

    def adopt(self, indices: Sequence[int]) -> None:
        """The model's parameters ``indices`` were written outside the engine: make their
        fp32 masters (this rank's part) and host low-precision copies the written values, the
        moments unchanged (torch's semantics). Called synchronized, between iterations."""
        ...

    def restore(self, indices: Sequence[int]) -> list[int] | None:
        """Write the engine's weights back over parameters ``indices`` (a discarded racing
        write), synchronously. Returns those it could not restore: an fp32 GPU tail bucket's
        parameter is its own master, so a write to it leaves nothing to restore from."""
        ...

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                frozen: FrozenIteration, priority: Priority) -> Published:
        """After ``after`` (a step or rollback of bucket ``b``), bring its weights back;
        ``frozen``: the iteration's settings (its number, watchdog, streamed parameters);
        ``priority``: the deadline order a reorderable lane may use (lanes.py)."""
        ...

    def home(self, index: int) -> torch.Tensor:
        """Weight-flow: the host tensor parameter ``index`` streams from."""
        ...

    def stall_hint(self) -> str:
        """What a lane that does not finish may be waiting for (watchdog messages)."""
        ...

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        """Placement-free copies of every trainable parameter's state (collective for ZeRO);
        ``tier=False``: without the storage tier's."""
        ...

    def close(self) -> None:
        ...
