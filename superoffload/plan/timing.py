"""Repeatable timings for the machine probes (three back-to-back quick profiles
disagreed by 2x on a shared host).

``repeat(fn, trials)``: one warm-up call (page faults, allocator, lazy init, thread start),
then `trials` timed calls; the median is the figure and the spread (max - min) / median says
how far to trust it. ``busy_flags`` turns a large spread, or a load average above the cores
this process may use, into a profile flag, so a profile measured on a busy host says so.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from superoffload.threads import usable_cores

SPREAD_WARN = 0.10
"""A probe whose trials spread more than this (relative to their median) is flagged."""


def repeat(fn: Callable[[], Any], trials: int, sync: Callable[[], None] = lambda: None,
           clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(median seconds, spread) of `trials` calls of `fn` after one warm-up call (`clock`:
    seconds now; tests pass a simulated one)."""
    if trials < 1:
        raise ValueError(f"repeat: trials={trials}: use a whole number >= 1")
    # the warm-up pays first-call costs (allocation, page faults, kernel selection) untimed
    fn()
    sync()
    times = []
    for _ in range(trials):
        t0 = clock()
        fn()
        # device work is asynchronous: the time counts only once it has finished
        sync()
        times.append(clock() - t0)
    # the median, not the best: a figure the engine meets on a typical call
    return statistics.median(times), relative_spread(times)


def relative_spread(times: Sequence[float]) -> float:
    """(max - min) / median of `times`: how far to trust their median (0 when it is 0)."""
    mid = statistics.median(times)
    return (max(times) - min(times)) / mid if mid > 0 else 0.0


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_flags(spreads: Mapping[str, float], load: float | None = None,
               cores: int | None = None) -> tuple[str, ...]:
    """A "busy host" flag when a probe spread more than SPREAD_WARN or the load average is
    above the usable cores (`load`, `cores`: the current ones unless given)."""
    load = load_average() if load is None else load
    cores = usable_cores() if cores is None else cores
    noisy = {k: v for k, v in spreads.items() if v > SPREAD_WARN}
    reasons = []
    # more runnable threads than cores: the probes shared the CPU with something else
    if load is not None and load > cores:
        reasons.append(f"load average {load:.1f} on {cores} usable cores")
    if noisy:
        reasons.append("trials spread " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(
            noisy.items())) + f" (> {SPREAD_WARN:.0%})")
    if not reasons:
        return ()
    return ("busy host while measuring: " + "; ".join(reasons) + ". Figures are medians of "
            "the trials; measure again on an idle machine (force=True) before trusting them",)
