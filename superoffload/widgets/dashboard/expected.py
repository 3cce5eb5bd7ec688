"""The planner's prediction as the dashboard compares it with the run: a step function of
expected iteration times (`Expected`, a step per settings in force) and the warning when the
engine time stays far from it (`prediction_gap`, `GapWatch`).

The warning must not flicker: it appears once the engine time has been more than
`GAP_FACTOR` away from the prediction for two windows in a row, and goes only once it has been
within `CLEAR_FACTOR` for two windows (or a new prediction took effect: a reconfiguration, a
calibration), so a run hovering around the threshold keeps one steady line. Pure, and
`GapWatch` holds only what was shown.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WARMUP_ITERATIONS = 10
"""Iterations after a prediction takes effect that are never compared with it (allocation,
page faults, thread start, the rebuild after a reconfiguration)."""
GAP_WINDOW = 10
"""A gap must hold for two consecutive windows of this many iterations to be reported."""
GAP_FACTOR = 2.0
"""Reported when the engine time is more than this factor away from the prediction."""


@dataclass(frozen=True, slots=True)
class Expected:
    """The planner's prediction for the settings in force from `from_iteration` on."""

    from_iteration: int
    iteration_s: float
    """One optimizer step: all micro-batches of the step."""
    tflops: float
    """Executed TFLOP/s (recompute included), as `plan.SimResult.tflops`."""
    calibrated: bool = False
    """Whether the profile behind it was fitted to this run (plan.calibrate)."""


def predicted_at(expected: Sequence[Expected], iterations: np.ndarray) -> np.ndarray:
    """Predicted iteration time (ms) in force at each iteration (NaN before the first)."""
    out = np.full(len(iterations), np.nan)
    for e in sorted(expected, key=lambda e: e.from_iteration):
        out[iterations >= e.from_iteration] = e.iteration_s * 1e3
    return out


@dataclass(frozen=True, slots=True)
class Gap:
    """A sustained difference between the engine time and the prediction."""

    factor: float
    """Median engine time of the last window / predicted time."""
    iterations: int
    """Iterations the gap has held for (two windows at least)."""


def _median(values: np.ndarray) -> float:
    finite = [float(v) for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def prediction_gap(iterations: np.ndarray, engine_ms: np.ndarray, expected: Sequence[Expected],
                   *, window: int = GAP_WINDOW, warmup: int = WARMUP_ITERATIONS,
                   factor: float = GAP_FACTOR) -> Gap | None:
    """A gap worth a warning: after `warmup` iterations under the prediction in force, the
    median engine time of each of the last two windows of `window` iterations is more than
    `factor` away from the prediction, on the same side. None otherwise (too early, too few
    iterations, within the factor, or a gap that came and went)."""
    if not expected:
        return None
    e = max(expected, key=lambda x: x.from_iteration)
    pred_ms = e.iteration_s * 1e3
    if not pred_ms > 0:
        return None
    sel = iterations >= e.from_iteration + warmup
    its, ms = iterations[sel], engine_ms[sel]
    if len(its) < 2 * window:
        return None
    older, newer = _median(ms[-2 * window:-window]) / pred_ms, _median(ms[-window:]) / pred_ms
    high = older > factor and newer > factor
    low = older < 1 / factor and newer < 1 / factor
    if not (high or low):
        return None
    return Gap(factor=newer, iterations=len(its))


CLEAR_FACTOR = 1.5
"""A shown gap warning goes once both windows are within this factor of the prediction."""


def gap_cleared(iterations: np.ndarray, engine_ms: np.ndarray, expected: Sequence[Expected],
                *, window: int = GAP_WINDOW, factor: float = CLEAR_FACTOR) -> bool:
    """True when the median engine time of each of the last two windows is within `factor`
    of the prediction in force (either side)."""
    if not expected:
        return True
    e = max(expected, key=lambda x: x.from_iteration)
    pred_ms = e.iteration_s * 1e3
    sel = iterations >= e.from_iteration
    ms = engine_ms[sel]
    if not pred_ms > 0 or len(ms) < 2 * window:
        return False
    ratios = (_median(ms[-2 * window:-window]) / pred_ms, _median(ms[-window:]) / pred_ms)
    return all(1 / factor <= r <= factor for r in ratios)


class GapWatch:
    """The gap warning a view shows, with hysteresis (module docstring)."""

    def __init__(self) -> None:
        self.shown: Gap | None = None
        self._prediction: tuple[int, float] | None = None

    def update(self, iterations: np.ndarray, engine_ms: np.ndarray,
               expected: Sequence[Expected]) -> Gap | None:
        """The warning to show now (None: none)."""
        e = max(expected, key=lambda x: x.from_iteration) if expected else None
        key = (e.from_iteration, e.iteration_s) if e is not None else None
        # a new prediction: judged afresh
        if key != self._prediction:
            self._prediction, self.shown = key, None
        gap = prediction_gap(iterations, engine_ms, expected)
        if gap is not None:
            self.shown = gap
        elif self.shown is not None and gap_cleared(iterations, engine_ms, expected):
            self.shown = None
        elif self.shown is not None and e is not None and e.iteration_s > 0:
            # held (between the two thresholds): the newest window's figure, still shown
            held = iterations >= e.from_iteration + WARMUP_ITERATIONS
            newer = _median(engine_ms[held][-GAP_WINDOW:]) / (e.iteration_s * 1e3)
            self.shown = Gap(factor=newer, iterations=int(held.sum()))
        return self.shown
