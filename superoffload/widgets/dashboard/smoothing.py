"""Smoothing of a per-iteration line: TensorBoard's debiased exponential moving average.

    smoothed = ema(values, weight)    # weight 0: the values themselves; 0.99: very smooth

The same rule as TensorBoard's scalar dashboard (its `smoothing` slider, 0 to 0.999): a
running average `last = weight * last + (1 - weight) * value` over the finite points in
order, divided by `1 - weight ** k` after k points, so the first points are not pulled
towards 0 (the debiasing of Kingma & Ba, "Adam", 2015, §3, applied to a plotted series). NaN
points (an iteration without CPU work has no "CPU step hidden") stay NaN and do not move
the average. Pure: `tests/test_widgets_view.py` checks it against a direct loop.
"""

from __future__ import annotations

import math

import numpy as np

MAX_WEIGHT = 0.999
"""The heaviest smoothing allowed (TensorBoard's slider stops there as well)."""


def check_weight(weight: float) -> float:
    """`weight` as a float in [0, MAX_WEIGHT]; a ValueError names the range otherwise."""
    value = float(weight)
    if not 0.0 <= value <= MAX_WEIGHT:
        raise ValueError(f"smoothing={weight!r}: use a weight between 0 (none) and "
                         f"{MAX_WEIGHT} (TensorBoard's range)")
    return value


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """The debiased exponential moving average of `values` (module docstring)."""
    weight = check_weight(weight)
    data = np.asarray(values, dtype=float)
    if weight == 0.0:
        return data.copy()
    out = np.full(len(data), np.nan)
    last, k = 0.0, 0
    for i, v in enumerate(data):
        if math.isnan(v):
            continue
        last = weight * last + (1.0 - weight) * v
        k += 1
        out[i] = last / (1.0 - weight ** k)
    return out
