"""Pure figures of the measured dashboard: derived per-iteration arrays and the status text.

    link utilisation %   100 x (bytes / iteration time) / the link's peak, per direction
                         (telemetry.metrics.link_utilisation_pct); the peak is the profile's
    tokens/s, TFLOP/s    tokens and executed FLOPs per iteration (plan.ModelShape) / time
    predicted            the planner's iteration time for the settings in force, a step
                         function over iterations (a reconfiguration starts a new step)
    reconfigure delta    median iteration time over up to `n` complete iterations before a
                         reconfiguration vs after it

Status lines are plain text (a view escapes them for HTML): no markup ever reaches a
terminal or `dash.summary()`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from superoffload.telemetry import metrics
from superoffload.widgets.runstate import RunState
from superoffload.widgets.series import DashboardState


@dataclass(frozen=True, slots=True)
class Expected:
    """The planner's prediction for the settings in force from `from_iteration` on."""

    from_iteration: int
    iteration_s: float
    tflops: float
    """Executed TFLOP/s (recompute included), as `plan.SimResult.tflops`."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What one iteration does, for tokens/s and TFLOP/s (None: not shown)."""

    tokens_per_iteration: int | None = None
    flops_per_iteration: float | None = None
    """Executed FLOPs (plan.ModelShape.executed_flops)."""
    d2h_peak_gbps: float | None = None
    h2d_peak_gbps: float | None = None
    profile_name: str = ""
    profile_note: str = ""
    """Where the profile comes from ("measured on this machine ...", "preset")."""


def predicted_at(expected: Sequence[Expected], iterations: np.ndarray) -> np.ndarray:
    """Predicted iteration time (ms) in force at each iteration (NaN before the first)."""
    out = np.full(len(iterations), np.nan)
    for e in sorted(expected, key=lambda e: e.from_iteration):
        out[iterations >= e.from_iteration] = e.iteration_s * 1e3
    return out


def measured_arrays(state: DashboardState, work: Workload,
                    expected: Sequence[Expected] = ()) -> dict[str, np.ndarray]:
    """`state.series()` plus "d2h_util_pct", "h2d_util_pct", "tokens_per_s", "tflops" and
    "predicted_ms" (NaN where unknown)."""
    out = state.series()
    wall_s = out["wall_ms"] / 1e3
    with np.errstate(divide="ignore", invalid="ignore"):
        for d, peak in (("d2h", work.d2h_peak_gbps), ("h2d", work.h2d_peak_gbps)):
            out[f"{d}_util_pct"] = np.array(
                [metrics.link_utilisation_pct(g, peak) for g in out[f"{d}_gbps_wall"]], dtype=float)
        tokens = work.tokens_per_iteration
        flops = work.flops_per_iteration
        out["tokens_per_s"] = tokens / wall_s if tokens else np.full(len(wall_s), np.nan)
        out["tflops"] = flops / wall_s / 1e12 if flops else np.full(len(wall_s), np.nan)
    out["predicted_ms"] = predicted_at(expected, out["iteration"])
    return out


def reconfigure_delta(iterations: np.ndarray, values: np.ndarray, at: int,
                      n: int = 10) -> tuple[float, float, int, int] | None:
    """(median before, median after, points before, points after) of `values` around
    iteration `at` (the first iteration under the new settings); None without points on
    both sides. The iteration right at the change pays the rebuild: it is left out."""
    before = [v for i, v in zip(iterations, values) if at - n <= i < at and not math.isnan(v)]
    after = [v for i, v in zip(iterations, values) if at < i <= at + n and not math.isnan(v)]
    if not before or not after:
        return None
    return statistics.median(before), statistics.median(after), len(before), len(after)


def robust_top(values: np.ndarray, *, also: np.ndarray | None = None, q: float = 95.0,
               headroom: float = 1.5) -> float | None:
    """The top of a y axis that shows the bulk of `values` (their q-th percentile x headroom)
    and all of `also` (e.g. the prediction): one stall of the machine must not flatten the
    rest of the line. None without finite values."""
    finite = values[np.isfinite(values)] if len(values) else values
    top = float(np.percentile(finite, q)) * headroom if len(finite) else None
    if also is not None and np.isfinite(also).any():
        extra = float(np.nanmax(also)) * 1.2
        top = extra if top is None else max(top, extra)
    return top


def fmt_rate(value: float, unit: str) -> str:
    """3 significant digits with k/M suffixes: 16400 -> "16.4k tokens/s"."""
    if math.isnan(value):
        return f"- {unit}"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix} {unit}"
    return f"{value:.3g} {unit}"


def fmt_pct(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value < 0.1:
        return f"{value:.2g} %"  # a CPU-only "link" is used a fraction of a percent
    return f"{value:.1f} %" if value < 10 else f"{value:.0f} %"


def _median_tail(values: np.ndarray, n: int = 20) -> float:
    tail = [v for v in values[-n:] if not math.isnan(v)]
    return statistics.median(tail) if tail else math.nan


def status_lines(state: DashboardState, work: Workload, expected: Sequence[Expected], *,
                 run_state: RunState | None, iteration: int | None,
                 ratio_fallback: float | None = None, title: str = "superoffload") -> list[str]:
    """The dashboard's status, one plain-text line each (see the module docstring)."""
    arrays = measured_arrays(state, work, expected)
    head = [title]
    if run_state is not None:
        head.append(run_state.value)
    if iteration is not None and iteration >= 0:
        head.append(f"iteration {iteration}")
    ratio = state.ratio_in_force()
    if ratio is not None:
        head.append(f"ratio {ratio[0]:.2f} (since it. {ratio[1]})")
    elif ratio_fallback is not None:
        head.append(f"ratio {ratio_fallback:.2f}")
    lines = [" · ".join(head)]
    if len(arrays["iteration"]):
        ms = _median_tail(arrays["wall_ms"])
        measured = [f"{ms:.2f} ms/iteration"]
        if work.tokens_per_iteration:
            measured.append(fmt_rate(_median_tail(arrays["tokens_per_s"]), "tokens/s"))
        if work.flops_per_iteration:
            measured.append(fmt_rate(_median_tail(arrays["tflops"]), "TFLOP/s"))
        text = "measured (median of the last 20): " + " · ".join(measured)
        if expected:
            e = max(expected, key=lambda x: x.from_iteration)
            pred = [f"{e.iteration_s * 1e3:.2f} ms"]
            if work.tokens_per_iteration:
                pred.append(fmt_rate(work.tokens_per_iteration / e.iteration_s, "tokens/s"))
            pred.append(fmt_rate(e.tflops, "TFLOP/s"))
            text += f" | predicted: {' · '.join(pred)} on profile {work.profile_name}"
            if work.profile_note:
                text += f" ({work.profile_note})"
        lines.append(text)
        if expected and not math.isnan(ms):
            off = ms / (max(expected, key=lambda x: x.from_iteration).iteration_s * 1e3)
            if not 0.5 <= off <= 2.0:
                lines.append(f"warning: measured is {off:.1f}x the prediction: the profile misses "
                             "something on this machine; plan.calibrate(profile, spans, shape) "
                             "fits it to this run (tutorial 07)")
        link = []
        for d, label, peak in (("d2h", "D2H", work.d2h_peak_gbps), ("h2d", "H2D", work.h2d_peak_gbps)):
            rate = _median_tail(arrays[f"{d}_gbps_busy"])
            if not math.isnan(rate):
                use = _median_tail(arrays[f"{d}_util_pct"])
                link.append(f"{label} {rate:.3g} GB/s" + ("" if math.isnan(use) else
                                                          f" (link use {fmt_pct(use)} of {peak:.3g} GB/s peak)"))
        parts = (["link while moving: " + ", ".join(link)] if link else [])
        parts.append(f"CPU step hidden {fmt_pct(_median_tail(arrays['overlap_pct']))}")
        parts.append(f"device idle {fmt_pct(_median_tail(arrays['idle_pct']))}")
        lines.append(" · ".join(parts))
    lines.append(f"{state.total_rollbacks} bucket rollbacks · {state.total_replays} replays · "
                 f"{len(state.skipped)} skipped steps")
    if state.reconfigures:
        at, text = state.reconfigures[-1]
        line = f"it. {at}: {text}"
        delta = reconfigure_delta(arrays["iteration"], arrays["wall_ms"], at)
        if delta is not None:
            b, a, nb, na = delta
            line += (f" · iteration time {b:.2f} -> {a:.2f} ms ({(a - b) / b * 100:+.1f} %, "
                     f"median of {nb} before / {na} after)")
        else:
            line += " · iteration time before/after: waiting for complete iterations"
        lines.append(line)
    return lines
