"""One number per metric over any window of iterations: the definition every view uses.

A figure over several iterations is **pooled**: the window's totals, divided as the metric
divides one iteration's. Bytes over the seconds the lane moved them; the CPU step time that
ran under device work over all CPU step time; seconds over iterations. A window of one
iteration is that iteration's value, so the per-iteration figures (`vocabulary.iteration_values`,
the dashboard's lines, TensorBoard, the trace) are this function at n = 1, and the dashboard's
bins, its status line, the Trainer/Lightning logs, the CLI's progress bar and its summary are
the same function over their own windows, which each view names beside the number
("last 20 iterations", "iterations 1-299", "since the previous log").

Why pooled, not the median or the mean of per-iteration values: per-iteration shares are
bimodal on a small model (an iteration's CPU step is either all under the next forward or all
after it: 0 % or 100 %), so their median jumps between the two and their mean weighs a 1 ms
CPU step as much as a 100 ms one. The pooled share answers "of the CPU step time in these
iterations, how much was hidden", and a rate "how many bytes per second of moving".

    window_values(iteration_metrics(spans)[-20:])   # {"iteration_ms": ..., "d2h_gbps_busy": ...}
    window_of(done, tokens=4096)                     # with the window's first/last iteration

`WEIGHTS` gives each per-iteration metric its denominator: a weighted mean of per-iteration
values with these weights is the pooled value (what `telemetry/binned.Binned` keeps per bin).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

GB = 1e9
"""Bytes in a GB (rates are decimal GB/s everywhere)."""


class PooledMetrics(Protocol):
    """What a window pools of one iteration (`telemetry.metrics.IterationMetrics` has it;
    declared here so this module depends on nothing of ours)."""

    @property
    def iteration(self) -> int: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def compute_s(self) -> float: ...
    @property
    def cpu_busy_s(self) -> float: ...
    @property
    def cpu_step_s(self) -> float: ...
    @property
    def cpu_hidden_s(self) -> float: ...
    @property
    def exposed_optimizer_s(self) -> float: ...
    @property
    def outside_engine_s(self) -> float: ...
    @property
    def d2h_bytes(self) -> int: ...
    @property
    def h2d_bytes(self) -> int: ...
    @property
    def d2h_busy_s(self) -> float: ...
    @property
    def h2d_busy_s(self) -> float: ...
    @property
    def rollbacks(self) -> int: ...
    @property
    def replays(self) -> int: ...

WINDOW_NAMES = ("iteration_ms", "engine_ms", "outside_engine_ms", "exposed_optimizer_ms",
                "d2h_gbps_busy", "h2d_gbps_busy", "d2h_gbps_wall", "h2d_gbps_wall",
                "cpu_step_hidden_pct", "cpu_busy_pct", "device_idle_pct", "rollbacks", "replays")
"""The metrics a window derives from spans alone (tokens/s, TFLOP/s and link use need the
workload or the link's reference rate: `window_values` adds them when given)."""

RECENT_ITERATIONS = 20
"""The window a live view pools: the last 20 complete iterations (the dashboard's status
line, the CLI's progress bar). Long enough that a bimodal per-iteration share settles."""

WEIGHTS: dict[str, Callable[[PooledMetrics], float]] = {
    "iteration_ms": lambda m: 1.0,
    "engine_ms": lambda m: 1.0,
    "outside_engine_ms": lambda m: 1.0,
    "exposed_optimizer_ms": lambda m: 1.0,
    "d2h_gbps_busy": lambda m: m.d2h_busy_s,
    "h2d_gbps_busy": lambda m: m.h2d_busy_s,
    "d2h_gbps_wall": lambda m: m.wall_s,
    "h2d_gbps_wall": lambda m: m.wall_s,
    "cpu_step_hidden_pct": lambda m: m.cpu_step_s,
    "cpu_busy_pct": lambda m: m.wall_s,
    "device_idle_pct": lambda m: m.wall_s,
    "rollbacks": lambda m: 1.0,
    "replays": lambda m: 1.0,
}
"""The denominator of each metric for one iteration: Σ(value x weight) / Σ weight over a
window is `window_values` (counts per iteration are plain means here; a window's status
shows their totals)."""


@dataclass(frozen=True, slots=True)
class Window:
    """A window of complete iterations and its pooled figures."""

    first: int
    """First iteration in the window (-1: empty)."""
    last: int
    iterations: int
    values: dict[str, float] = field(default_factory=dict)
    """Vocabulary name -> pooled value in the metric's unit (NaN where undefined)."""

    def label(self) -> str:
        """"iterations 10-29" (or "iteration 7", or "no complete iteration yet")."""
        if self.iterations == 0:
            return "no complete iteration yet"
        if self.first == self.last:
            return f"iteration {self.first}"
        return f"iterations {self.first}-{self.last}"


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def window_values(ms: Sequence[PooledMetrics], *, tokens: float | None = None,
                  flops_per_iteration: float | None = None, d2h_reference_gbps: float | None = None,
                  h2d_reference_gbps: float | None = None) -> dict[str, float]:
    """The pooled figures of the iterations `ms` in the vocabulary's names and units (module
    docstring), plus tokens/s (`tokens` trained in the window), TFLOP/s (executed FLOPs per
    iteration) and link use (% of each direction's reference rate) when those are given.
    Empty input: every value NaN. An undefined share or rate is NaN: no CPU step hides
    nothing (not 100 %), a direction that moved no bytes has no rate."""
    n = len(ms)
    wall = sum(m.wall_s for m in ms)
    outside = sum(m.outside_engine_s for m in ms)
    out = {
        "iteration_ms": _div(wall, n) * 1e3,
        "engine_ms": _div(wall - outside, n) * 1e3,
        "outside_engine_ms": _div(outside, n) * 1e3,
        "exposed_optimizer_ms": _div(sum(m.exposed_optimizer_s for m in ms), n) * 1e3,
        "cpu_busy_pct": 100.0 * _div(sum(m.cpu_busy_s for m in ms), wall),
        "device_idle_pct": 100.0 * (1.0 - _div(sum(m.compute_s for m in ms), wall)),
        "cpu_step_hidden_pct": 100.0 * _div(sum(m.cpu_hidden_s for m in ms),
                                            sum(m.cpu_step_s for m in ms)),
        "rollbacks": float(sum(m.rollbacks for m in ms)) if n else math.nan,
        "replays": float(sum(m.replays for m in ms)) if n else math.nan,
    }
    for d in ("d2h", "h2d"):
        moved = sum(getattr(m, f"{d}_bytes") for m in ms)
        busy = sum(getattr(m, f"{d}_busy_s") for m in ms)
        out[f"{d}_gbps_busy"] = moved / busy / GB if moved and busy > 0 else math.nan
        out[f"{d}_gbps_wall"] = moved / wall / GB if wall > 0 else math.nan
    if tokens:
        out["tokens_per_s"] = _div(tokens, wall)
    if flops_per_iteration:
        out["tflops"] = _div(flops_per_iteration * n, wall) / 1e12
    for d, ref in (("d2h", d2h_reference_gbps), ("h2d", h2d_reference_gbps)):
        if ref:
            out[f"{d}_link_use_pct"] = 100.0 * out[f"{d}_gbps_wall"] / ref if ref > 0 else math.nan
    return out


def window_of(ms: Sequence[PooledMetrics], **kw: float | None) -> Window:
    """`window_values(ms, **kw)` with the window's first and last iteration."""
    if not ms:
        return Window(-1, -1, 0, window_values(ms, **kw))
    return Window(ms[0].iteration, ms[-1].iteration, len(ms), window_values(ms, **kw))
