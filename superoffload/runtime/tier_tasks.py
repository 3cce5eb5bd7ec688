"""The storage tier's lane tasks and the pool slot they work on (runtime/tier.py): read a
bucket's state into its slot, write it back, free the slot once the device has read it.
Frozen task dataclasses run by the tier's two lanes (runtime/lanes.py)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Mover(Protocol):
    """What the tasks call of the tier (runtime/tier.py ``StateTier``)."""

    def read_into(self, b: int, slot: Slot, *, grad: bool, cast_lp: bool) -> None: ...

    def write_from(self, b: int, slot: Slot, *, state: bool, grad: bool) -> int | None: ...

    def release(self, b: int, slot: Slot, published: Future[Any] | None) -> None: ...


@dataclass(slots=True)
class Slot:
    """One pinned buffer of the pool and the bucket bound to it."""

    index: int
    memory: torch.Tensor
    """uint8, ``ALIGN``-aligned, ``TierPlan.slot.nbytes`` long."""
    owner: int | None = None
    launched: bool = False
    """The owner was bound by a launch or a load: its slot holds work (not only a read ahead)."""
    loaded: Future[Any] | None = None
    """The read of the owner's state (and gradient), done when the slot holds them."""


@dataclass(frozen=True, slots=True)
class TierRead:
    """Read a bucket's state in force (and its spilled gradient) into its slot."""

    bucket: int
    tier: Mover
    slot: Slot
    grad: bool
    cast_lp: bool
    """Fill the low-precision copy from the master (a publish of these weights follows)."""

    def run(self) -> None:
        self.tier.read_into(self.bucket, self.slot, grad=self.grad, cast_lp=self.cast_lp)


@dataclass(frozen=True, slots=True)
class TierWrite:
    """Write a bucket's slot back: its state to the version not in force (when the step that
    came before ran), its gradient to the gradient region (``grad``). Returns the version
    written, or None."""

    bucket: int
    tier: Mover
    slot: Slot
    step: Future[Any] | None
    """The step whose result is written (None: write the state regardless)."""
    state: bool
    grad: bool
    d2h: Future[Any] | None
    """The gradients' move into the slot: the write waits until it has landed (CUDA)."""

    def run(self) -> int | None:
        if self.d2h is not None:
            stats = self.d2h.result()
            if stats is not None:
                # CUDA: the copy into the slot has landed
                stats.resolve()
        ran = True if self.step is None else self.step.result()
        return self.tier.write_from(self.bucket, self.slot, state=self.state and bool(ran),
                                    grad=self.grad)


@dataclass(frozen=True, slots=True)
class TierRelease:
    """Free a slot once its write ended and its publish's device copy has read it."""

    bucket: int
    tier: Mover
    slot: Slot
    published: Future[Any] | None

    def run(self) -> None:
        self.tier.release(self.bucket, self.slot, self.published)
