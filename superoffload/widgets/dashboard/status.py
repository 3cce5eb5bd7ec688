"""Pure figures of the measured dashboard: derived per-iteration arrays and the status text.

Every figure is a `telemetry.vocabulary` metric (its name, unit and definition):

    link use %           D2H / H2D per iteration over the link's peak (the profile's)
    tokens/s, TFLOP/s    tokens and executed FLOPs per iteration / iteration time; an
                         iteration is one optimizer step: `grad_accum_steps` micro-batches
    predicted            the planner's time for one optimizer step under the settings in
                         force, a step function over iterations (a reconfiguration starts a
                         new step); it is compared with the engine time (the window minus the
                         loop's own work outside the engine), like with like
    a change's effect    measured by the tuner's interleaved A/B (runtime/ab_trial.py):
                         its result line, from the run's notes, is shown as it is

Status lines are plain text (a view escapes them for HTML, and colours a "warning:" line):
no markup ever reaches a terminal or `dash.summary()`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.metrics import link_utilisation_pct
from superoffload.telemetry.vocabulary import METRICS, format_value, plain
from superoffload.widgets.dashboard.expected import (
    Expected,
    GapWatch,
    predicted_at,
    prediction_gap,
)
from superoffload.widgets.dashboard.link import CPU_ONLY_NOTE, Link
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.shared.runstate import RunState

__all__ = ["Workload", "measured_arrays", "robust_top", "status_lines"]

@dataclass(frozen=True, slots=True)
class Workload:
    """What one iteration does, for tokens/s and TFLOP/s (None: not shown)."""

    tokens_per_iteration: int | None = None
    """Tokens of every micro-batch of one optimizer step."""
    flops_per_iteration: float | None = None
    """Executed FLOPs of one optimizer step (plan.ModelShape.executed_flops x micro-batches)."""
    d2h_peak_gbps: float | None = None
    h2d_peak_gbps: float | None = None
    profile_name: str = ""
    profile_note: str = ""
    """Where the profile comes from ("measured on this machine ...", "preset")."""
    micro_batches: int = 1
    """Micro-batches per optimizer step (the engine's grad_accum_steps)."""
    link_rate_kind: str = "peak"
    """What the profile's link rates are: "peak" (a preset's datasheet figure), "measured"
    (this machine's best copy in `plan.measure_local`) or "fitted" (calibrated to a run: a
    fit, which a measured rate may exceed; never called a peak)."""
    link: Link | None = None
    """The link the profile's machine has, and what the overlap figures mean over it."""

    @property
    def link_name(self) -> str:
        """"NVLink-C2C", "PCIe", "memory copy", ... ("" without a profile)."""
        return self.link.name if self.link is not None else ""

    @property
    def link_rate_name(self) -> str:
        """"peak", "measured best copy" or "fitted rate": what a view calls the reference."""
        return {"peak": "peak", "measured": "measured best copy"}.get(self.link_rate_kind,
                                                                     "fitted rate")


def measured_arrays(state: DashboardState, work: Workload,
                    expected: Sequence[Expected] = ()) -> dict[str, np.ndarray]:
    """`state.series()` plus "tokens_per_s", "tflops", "d2h_link_use_pct",
    "h2d_link_use_pct" (each with "_min" / "_max") and "predicted_ms" (NaN where unknown)."""
    out = state.series()
    with np.errstate(divide="ignore", invalid="ignore"):
        for d, peak in (("d2h", work.d2h_peak_gbps), ("h2d", work.h2d_peak_gbps)):
            for suffix in ("", "_min", "_max"):
                wall = out[f"{d}_gbps_wall{suffix}"]
                out[f"{d}_link_use_pct{suffix}"] = (100.0 * wall / peak if peak and peak > 0
                                                     else np.full(len(wall), np.nan))
        for key, per_iteration, scale in (("tokens_per_s", work.tokens_per_iteration, 1.0),
                                          ("tflops", work.flops_per_iteration, 1e-12)):
            for suffix, source in (("", ""), ("_min", "_max"), ("_max", "_min")):
                # the fastest bin has the most
                seconds = out[f"iteration_ms{source}"] / 1e3
                out[f"{key}{suffix}"] = (per_iteration * scale / seconds if per_iteration
                                         else np.full(len(seconds), np.nan))
    out["predicted_ms"] = predicted_at(expected, out["iteration"])
    return out


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


CALIBRATE_LINE = "dash.calibrate()"
"""The runnable line a prediction-gap warning offers (fits the profile to this run)."""


def status_lines(state: DashboardState, work: Workload, expected: Sequence[Expected], *,
                 run_state: RunState | None, iteration: int | None,
                 ratio_fallback: float | None = None, title: str = "superoffload",
                 gaps: GapWatch | None = None, notes: Sequence[str] = (),
                 calibration: Any = None) -> list[str]:
    """The dashboard's status, one plain-text line each (see the module docstring): the
    run's state, then the key figures pooled over the last complete iterations (the window
    named first), a warning when there is one, the events, a note on a CPU-only machine; the
    details after them (`STATUS_HEAD` lines are what a view shows unfolded, and the warning
    and the note). `gaps` holds the warning steady (`expected.GapWatch`); without it each
    call judges afresh. `notes`: lines kept in view right after the state ("note: ..."),
    `calibration`: the last `plan.autocal.CalibrationReport`, its line in the details."""
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
    lines = [" · ".join(head), *(f"note: {n}" for n in notes)]
    details: list[str] = []
    if state.plotted_rank is None:
        lines.append("waiting for the first complete iteration (an iteration is complete once "
                     "the one after the next has started)")
    else:
        key, warning, details = _measured_lines(state, work, expected, run_state, gaps)
        lines.append(key)
        if warning:
            lines.append(warning)
    events = [f"{state.total_rollbacks} bucket rollbacks · {state.total_replays} replays · "
              f"{len(state.skipped)} skipped steps"]
    if state.ab_trials:
        t = state.ab_trials[-1]
        if t.end is None:
            events.append(f"A/B running since it. {t.start}: {t.what}; old and new settings "
                          "alternate, the measured change follows")
        else:
            events.append(f"it. {t.start}-{t.end}: {t.result}")
    elif state.reconfigures:
        at, text = state.reconfigures[-1]
        events.append(f"it. {at}: {text}")
    lines.append(" · ".join(events))
    if work.link is not None and work.link.cpu_only:
        lines.append(CPU_ONLY_NOTE)
    if work.link is not None:
        details.append(f"link: {work.link.name}: {work.link.meaning}")
    if state.ab_trials and state.reconfigures:
        at, text = state.reconfigures[-1]
        details.append(f"last change: it. {at}: {text}")
    if calibration is not None:
        details.append(calibration.line())
    cover = state.coverage()
    if cover is not None and state.stride() > 1:
        details.append(f"history: iterations {cover[0]}-{cover[1]} in bins of "
                       f"{state.stride()} (line = each bin pooled, band = its min..max)")
    return lines + details


STATUS_HEAD = 3
"""Status lines a view shows unfolded (state, key figures, events; a warning line too);
the rest (prediction, link use, calibration, history) folds under "details"."""


def _measured_lines(state: DashboardState, work: Workload, expected: Sequence[Expected],
                    run_state: RunState | None,
                    gaps: GapWatch | None) -> tuple[str, str, list[str]]:
    """(the key figures line, a warning or "", detail lines), every figure pooled over the
    window the key line names (`telemetry.window`, the definition every view uses)."""
    M = METRICS
    win = state.recent_window()
    values = dict(win.values)
    # tokens and FLOPs per iteration over the mean iteration time: pooled too
    if win.iterations:
        values.update(vocab.workload_values(values["iteration_ms"],
                                            tokens_per_iteration=work.tokens_per_iteration,
                                            flops_per_iteration=work.flops_per_iteration))
    time_part = f"{M['iteration_ms'].label} {format_value(values['iteration_ms'], 'ms')}"
    e = max(expected, key=lambda x: x.from_iteration) if expected else None
    if e is not None:
        how = "calibrated" if e.calibrated else "not calibrated"
        time_part += f" (predicted {format_value(e.iteration_s * 1e3, 'ms')}, {how})"
    parts = [time_part]
    if "tokens_per_s" in values:
        parts.append(M["tokens_per_s"].show(values["tokens_per_s"]))
    for d in ("d2h", "h2d"):
        if not math.isnan(values[f"{d}_gbps_busy"]):
            parts.append(M[f"{d}_gbps_busy"].show(values[f"{d}_gbps_busy"]))
    parts += [M[k].show(values[k]) for k in ("cpu_step_hidden_pct", "device_idle_pct")]
    key = f"{win.label()}, pooled: " + " · ".join(parts)
    details = [_prediction_line(values, work, e)]
    link = _link_line(values, work)
    if link:
        details.append(link)
    recent = state.recent()
    gap = (gaps.update(recent["iteration"], recent["engine_ms"], expected) if gaps is not None
           else prediction_gap(recent["iteration"], recent["engine_ms"], expected))
    warning = ""
    if gap is not None and (run_state is None or run_state is RunState.RUNNING):
        warning = (f"warning: engine time {gap.factor:.1f}x the prediction for "
                   f"{gap.iterations} iterations; {CALIBRATE_LINE} fits the profile to this run")
    return key, warning, details


def _prediction_line(values: dict[str, float], work: Workload, e: Expected | None) -> str:
    M = METRICS
    measured = [M["engine_ms"].show(values["engine_ms"])]
    if "tflops" in values:
        measured.append(M["tflops"].show(values["tflops"]))
    text = "measured: " + " · ".join(measured)
    if e is not None:
        pred = [f"{M['iteration_ms'].label} {format_value(e.iteration_s * 1e3, 'ms')}"]
        pred += [M[k].show(v) for k, v in vocab.workload_values(
            e.iteration_s * 1e3, tokens_per_iteration=work.tokens_per_iteration).items()]
        pred.append(M["tflops"].show(e.tflops))
        steps = f" for {work.micro_batches} micro-batches" if work.micro_batches > 1 else ""
        how = "calibrated" if e.calibrated else "not calibrated"
        if work.profile_note:
            how += "; " + work.profile_note
        text += f" | predicted{steps}: {' · '.join(pred)} on profile {work.profile_name} ({how})"
    return text


def _link_line(values: dict[str, float], work: Workload) -> str:
    """Link use against the planner's rates, named for what they are; a measured rate above
    a fitted one is said to be so (the fit is no bound)."""
    parts = []
    for d, ref in (("d2h", work.d2h_peak_gbps), ("h2d", work.h2d_peak_gbps)):
        busy = values[f"{d}_gbps_busy"]
        if not ref or math.isnan(busy):
            continue
        use = link_utilisation_pct(values[f"{d}_gbps_wall"], ref)
        part = (f"{METRICS[f'{d}_link_use_pct'].show(use)} of the planner's {plain(ref)} GB/s "
                f"({work.link_rate_name})")
        if busy > ref:
            part += f"; moving at {busy / ref:.3g}x that rate"
        # a fitted rate is no bound: a measured rate above it says the fit is low, not a fault
        if busy > ref and work.link_rate_kind == "fitted":
            part += " (a fit, not a bound)"
        parts.append(part)
    return " · ".join(parts)


def rank_lines(state: DashboardState) -> list[str]:
    """One line per rank when several trained (data parallel): each rank's recent window,
    pooled; none for a single rank."""
    if len(state.history_by_rank) < 2:
        return []
    out = []
    for rank in sorted(state.history_by_rank):
        win = state.recent_window(rank)
        if win.iterations:
            out.append(f"rank {rank}, {win.label()} pooled: " + vocab.describe_values(win.values, (
                "iteration_ms", "d2h_gbps_busy", "h2d_gbps_busy", "cpu_step_hidden_pct",
                "device_idle_pct")))
    return out
