"""Speculation-then-validation: the pure decision logic (paper §4.3, DESIGN.md §3 step 3).

The CPU steps each offloaded bucket before the global gradient norm and the inf/nan
verdict are known. After backward the engine sums the buckets' local statistics and asks
``verdict()`` what to do; ``AdaptiveSTV`` decides, iteration by iteration, whether to
speculate at all. No threads, no tensors: unit-tested in tests/test_stv.py.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Action(Enum):
    COMMIT = "commit"
    """Every speculative step stands."""
    CLIP = "clip"
    """Roll speculative steps back and replay them with the clipped gradient."""
    SKIP = "skip"
    """Overflow: roll back and skip the step (fp16 shrinks the loss scale)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    grad_norm: float
    """Global norm of the unscaled gradient (inf/nan on overflow)."""
    grad_scale: float
    """Factor the kernel applies to the stored (loss-scaled) gradient: clip / loss_scale."""


def verdict(
    sum_sq_scaled: float, nonfinite: int, *, loss_scale: float, max_grad_norm: float | None
) -> Verdict:
    """Decide the iteration from the summed local statistics.

    Clip coefficient as ``torch.nn.utils.clip_grad_norm_``: max_norm / (norm + 1e-6), applied
    only when it is < 1 (PyTorch docs, clip_grad_norm_).
    """
    if nonfinite or not math.isfinite(sum_sq_scaled):
        return Verdict(Action.SKIP, math.inf, 0.0)
    norm = math.sqrt(sum_sq_scaled) / loss_scale
    unscale = 1.0 / loss_scale
    if max_grad_norm:
        coef = max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            return Verdict(Action.CLIP, norm, coef * unscale)
    return Verdict(Action.COMMIT, norm, unscale)


class AdaptiveSTV:
    """Speculate unless clipping fires often (warm-up), then resume when it calms down.

    Over the last ``window`` iterations: speculation switches off when the share of clipped
    iterations exceeds ``threshold`` and back on when it falls to ``threshold / 2`` or below
    (hysteresis, so it does not flap). The paper reports clipping in 0.12% of BLOOM-176B's
    steps, mostly early; a replay costs a second CPU step, so a clipping-heavy phase is
    cheaper without speculation.
    """

    def __init__(self, *, mode: str, window: int, threshold: float) -> None:
        self.mode = mode
        self.window = window
        self.threshold = threshold
        self.history: deque[bool] = deque(maxlen=window)
        self.enabled = mode != "off"

    def configure(self, *, mode: str, window: int, threshold: float) -> None:
        self.mode, self.window, self.threshold = mode, window, threshold
        self.history = deque(self.history, maxlen=window)
        if mode == "on":
            self.enabled = True
        elif mode == "off":
            self.enabled = False

    @property
    def clip_rate(self) -> float:
        return sum(self.history) / len(self.history) if self.history else 0.0

    def observe(self, clipped: bool) -> str | None:
        """Record one iteration's outcome; return a note when speculation switches."""
        self.history.append(bool(clipped))
        if self.mode != "adaptive":
            return None
        rate, n = self.clip_rate, len(self.history)
        clipped_count = sum(self.history)
        if self.enabled and rate > self.threshold:
            self.enabled = False
            return (f"adaptive STV: speculation off, clipping fired in {clipped_count} of the "
                    f"last {n} iterations (> {self.threshold:.0%})")
        if not self.enabled and rate <= self.threshold / 2:
            self.enabled = True
            return (f"adaptive STV: speculation back on, clipping fired in {clipped_count} of "
                    f"the last {n} iterations")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "history": [bool(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A fixed mode wins over the saved switch; "adaptive" resumes where it was.
        self.enabled = bool(state["enabled"]) if self.mode == "adaptive" else self.mode == "on"
        self.history = deque((bool(h) for h in state["history"]), maxlen=self.window)
