"""Skipped steps: the settings that would skip every step, and a run that skips step after step.

A step is skipped when some gradient is non-finite, or when the step would make the optimizer
state non-finite (runtime/state_overflow.py); with fp16's dynamic loss scale an overflow is
how the scale finds its level, and the scaler halves it (runtime/loss_scaler.py). Anything
else that skips several steps in a row is a run that has stopped learning, which must not
look like one that trains:

* ``eps <= 0`` is refused where the engine reads its param groups (``kernels/hyper.py``
  ``hypers_of``: at ``initialize`` and every step). torch accepts ``eps=0``, and its AdamW then
  divides 0 by 0 for every element whose gradient has been 0 at every step so far (m = v = 0:
  an unused embedding row, a dead unit), writing NaN into those weights; the engine never
  writes a non-finite state, so it would skip every such step instead
  (docs/failure_semantics.md, "What you may do with the engine", says why it refuses).
* ``EngineStats.skip_streak`` counts the steps skipped in a row that the loss scale does not
  account for (``LossScaler.update`` says which it does; runtime/stv.py ``close_iteration``
  counts); when it reaches ``SKIP_STREAK``, ``say`` warns (``SkippedSteps``) and notes in the
  telemetry the cause (non-finite gradients, or the state, with the buckets and their first
  parameters) and what to do. The count is also the ``skip_streak`` telemetry scalar. Nothing
  here runs on a step that is not skipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from superoffload.telemetry.recorder import Recorder

SKIP_STREAK = 3
"""Steps skipped in a row, not by the loss scale, before the run says so: one skip is a
spike (the step is dropped, as with torch's GradScaler), three in a row a run that no longer
moves."""

GRADIENT, STATE = "gradient", "state"
"""Why a bucket stopped the step: a non-finite gradient, or a step that would make the
optimizer state non-finite."""


class SkippedSteps(RuntimeWarning):
    """The engine skipped ``SKIP_STREAK`` steps in a row for a reason other than fp16's loss
    scale: the weights have not moved since."""


@dataclass(frozen=True, slots=True)
class Cause:
    """One bucket that stopped a step on this rank."""

    kind: str
    """``GRADIENT`` or ``STATE``."""
    bucket: int
    first_param: str
    """The name of the bucket's first parameter (what a reader can find in the model)."""


def say(streak: int, iteration: int, causes: Sequence[Cause], recorder: Recorder) -> str:
    """The streak reached ``SKIP_STREAK`` at ``iteration``: a telemetry note and a
    ``SkippedSteps`` warning (shown by Python, notebooks and loggers). Returns the text."""
    text = streak_message(streak, iteration, causes)
    recorder.note(iteration, text)
    warnings.warn(text, SkippedSteps, stacklevel=2)
    return text


def streak_message(streak: int, iteration: int, causes: Sequence[Cause]) -> str:
    """What the run says when ``streak`` reaches ``SKIP_STREAK`` at ``iteration``."""
    first = iteration - streak + 1
    what = {GRADIENT: "a non-finite gradient",
            STATE: "a step that would make the optimizer state non-finite"}
    where = "; ".join(f"{what[kind]} in {_buckets([c for c in causes if c.kind == kind])}"
                      for kind in (GRADIENT, STATE) if any(c.kind == kind for c in causes))
    if not causes:
        where = "a non-finite gradient or state on another rank"
    advice = []
    if not causes or any(c.kind == GRADIENT for c in causes):
        advice.append("look for inf/nan in the loss and the data (a log of 0, a division by "
                      "zero, a learning rate that diverged: engine.grad_norm() is inf)")
    if any(c.kind == STATE for c in causes):
        advice.append("lower the learning rate or clip (max_grad_norm): (1-b2) g^2 overflows "
                      "fp32 or the update leaves its range")
    return (f"the engine skipped {streak} steps in a row (iterations {first}-{iteration}), not "
            f"because of fp16's loss scale: {where}. The weights are still those from before "
            f"iteration {first}; {', or '.join(advice)}")


def _buckets(causes: Sequence[Cause]) -> str:
    """"bucket 2 ('blocks.0.fc1.weight', ...)", the first three and how many more."""
    shown = ", ".join(f"{c.bucket} ({c.first_param!r}...)" for c in causes[:3])
    more = f" and {len(causes) - 3} more" if len(causes) > 3 else ""
    return f"bucket{'s' if len(causes) > 1 else ''} {shown}{more}"
