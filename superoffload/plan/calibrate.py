"""Fit a profile's rates to what the engine measured (its telemetry spans), so the simulator
predicts this machine (DESIGN.md §5: "reproduces the engine's measured timeline").

Fits, each a robust one-parameter (or latency + rate) fit on medians:
  compute      achieved FLOP/s = median over iterations of executed FLOPs / (forward + backward
               busy time); busy time is the union of the iteration's forward and backward spans,
               so spans measured on the GPU clock (CUDA events, aligned to the host clock: per
               module, nested or overlapping the host's enqueue spans) count each instant once;
               needs the ModelShape the spans came from
  CPU Adam     t = call + params / rate   (cpu_step spans; params = nbytes / 28, as the engine
               records 28 B per parameter stepped). The fitted rate is the CPU lane's, host-bus
               contention with the DMA included, so it goes in as the kernel's rate at the
               spans' bytes: the simulator's max(compute, bus) then reproduces it
  device Adam  launch + params / rate from device_step spans (params = nbytes / 28); the device
               bandwidth is rate x the tail step's bytes per parameter (118 unfused, 28 fused)
  links        t = latency + bytes / bandwidth per direction (d2h, h2d spans)
The first iteration (warm-up: allocation, page faults, thread start) is dropped when there are
several. Spans of kind replay/rollback are ignored. `fit_compute` fits the achieved FLOP/s to a
measured plain (no offload) iteration instead, as bench_engine.py and the H200 profile do.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from superoffload.plan import compute
from superoffload.plan.cost import (
    FUSED_TAIL_LAUNCHES,
    UNFUSED_TAIL_LAUNCHES,
    tail_bytes_per_param,
)
from superoffload.plan.hardware import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.schedule import ENGINE
from superoffload.plan.shapes import ModelShape
from superoffload.telemetry import events as ev


@dataclass
class Measurements:
    """Raw (size, seconds) samples, from spans or from elsewhere."""

    compute: list[tuple[float, float]] = field(default_factory=list)
    """(FLOPs, seconds) per iteration."""
    cpu_step: list[tuple[float, float]] = field(default_factory=list)
    """(parameters, seconds) per CPU optimizer call."""
    device_step: list[tuple[float, float]] = field(default_factory=list)
    """(parameters, seconds) per device optimizer call."""
    d2h: list[tuple[float, float]] = field(default_factory=list)
    """(bytes, seconds) per transfer."""
    h2d: list[tuple[float, float]] = field(default_factory=list)
    """(bytes, seconds) per transfer."""
    cpu_threads: int | None = None
    """Threads the CPU optimizer ran with (for the profile's Adam table)."""


def measurements_from_spans(spans: Iterable[ev.Span], shape: ModelShape | None = None,
                            *, drop_first: bool = True, cpu_threads: int | None = None
                            ) -> Measurements:
    """Collect samples from engine (or simulator) spans. Compute needs `shape`."""
    spans = list(spans)
    iters = sorted({s.iteration for s in spans})
    if drop_first and len(iters) > 2:
        spans = [s for s in spans if s.iteration != iters[0]]
    out = Measurements(cpu_threads=cpu_threads)
    compute: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        d = s.duration_s
        if d <= 0:
            continue
        if s.kind in (ev.KIND_FORWARD, ev.KIND_BACKWARD):
            compute[s.iteration].append((s.start_s, s.end_s))
        elif s.kind == ev.KIND_CPU_STEP and s.nbytes > 0:
            out.cpu_step.append((s.nbytes / ADAM_BYTES_PER_PARAM, d))
        elif s.kind == ev.KIND_DEVICE_STEP and s.nbytes > 0:
            out.device_step.append((s.nbytes / ADAM_BYTES_PER_PARAM, d))
        elif s.kind == ev.KIND_D2H and s.nbytes > 0:
            out.d2h.append((float(s.nbytes), d))
        elif s.kind == ev.KIND_H2D and s.nbytes > 0:
            out.h2d.append((float(s.nbytes), d))
    if shape is not None:
        busy = (union_s(v) for v in compute.values())
        out.compute = [(shape.executed_flops, t) for t in busy if t > 0]
    return out


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def fit_latency_rate(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, rate per second) for t = latency + size / rate. With one distinct size (or a
    fit that comes out negative) the latency is 0 and the rate is the median of size/t.
    Sizes are grouped and each group's median time is used, so outliers do not steer the line."""
    if not samples:
        raise ValueError("fit_latency_rate: no samples")
    groups: dict[float, list[float]] = defaultdict(list)
    for size, t in samples:
        groups[size].append(t)
    pts = sorted((size, statistics.median(ts)) for size, ts in groups.items())
    if len(pts) >= 2:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        # least squares of time over size: the intercept is the latency, 1 / slope the rate
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        lat = my - slope * mx
        if slope > 0 and lat >= 0:
            return lat, 1.0 / slope
    # one size, or a fit with no physical meaning (negative latency or slope): no latency, the
    # median rate
    return 0.0, statistics.median(size / t for size, t in samples)


def calibrate(profile: HardwareProfile, data: Measurements | Iterable[ev.Span],
              shape: ModelShape | None = None, *, cpu_threads: int | None = None,
              adam_bytes_per_param: float = ADAM_BYTES_PER_PARAM,
              tail_step: str = ENGINE.tail_step) -> HardwareProfile:
    """A copy of `profile` whose rates match the measurements (figures with no samples keep the
    profile's value). `data`: Measurements, or spans (then pass `shape` to fit compute).
    `adam_bytes_per_param`: what the measured CPU pass touched per parameter (28 for fp32
    gradients and no fused cast, as an fp32 model runs); the profile's Adam rate is stated at
    28 B, so the fitted rate is scaled by adam_bytes_per_param / 28. `tail_step`: the device
    step the spans came from (default: the engine's, plan.schedule.ENGINE, "fused"; pass
    "unfused" for spans of the engine at ef04687, plan.facts.H200_ENGINE), for its bytes/param."""
    if isinstance(data, Measurements):
        m = data
    else:
        m = measurements_from_spans(data, shape, cpu_threads=cpu_threads)
    threads = m.cpu_threads or cpu_threads or profile.cpu_cores
    changes: dict[str, object] = {}
    sources = dict(profile.sources)
    if m.compute and shape is not None:
        # the compute lane's whole model (matmuls, element-wise, dispatch: plan/compute.py)
        # scaled by one factor to the measured busy time, so its measured split is kept
        busy = statistics.median(t for _, t in m.compute)
        factor = compute.iteration_compute_s(shape, profile) / busy
        profile = compute.scaled(profile, factor, "calibrated from engine spans")
        sources["device_achieved_tflops"] = "calibrated from engine spans"
    elif m.compute:
        tflops = statistics.median(f / t for f, t in m.compute) / 1e12
        changes["device_achieved_tflops"] = tflops
        changes["device_peak_tflops"] = max(profile.device_peak_tflops, tflops)
        sources["device_achieved_tflops"] = "calibrated from engine spans"
    if m.cpu_step:
        call, rate = fit_latency_rate(m.cpu_step)
        changes["cpu_call_s"] = call
        rate *= adam_bytes_per_param / ADAM_BYTES_PER_PARAM
        changes["cpu_adam_table"] = ((threads, rate),)
        changes["cpu_adam_params_per_s_per_core"] = rate / threads
        sources["cpu_adam_params_per_s_per_core"] = "calibrated from engine spans"
    if m.device_step:
        launch, rate = fit_latency_rate(m.device_step)
        changes["device_mem_bw_gbps"] = rate * tail_bytes_per_param(tail_step) / 1e9
        launches = FUSED_TAIL_LAUNCHES if tail_step == "fused" else UNFUSED_TAIL_LAUNCHES
        changes["device_launch_s"] = launch / launches
        sources["device_mem_bw_gbps"] = "calibrated from engine spans (device Adam rate)"
    lats = []
    for direction, samples in (("d2h", m.d2h), ("h2d", m.h2d)):
        if samples:
            lat, rate = fit_latency_rate(samples)
            changes[f"{direction}_gbps"] = rate / 1e9
            changes[f"{direction}_table"] = ()
            lats.append(lat)
            sources[f"{direction}_gbps"] = "calibrated from engine spans"
    if lats:
        changes["link_latency_s"] = statistics.fmean(lats)
    changes["sources"] = tuple(sources.items())
    name = profile.name
    if not name.endswith("-calibrated"):
        # calibrating a calibrated profile again keeps one suffix, not a growing chain
        name = name + "-calibrated"
    changes["name"] = name
    return profile.replace(**changes)


@dataclass(frozen=True, slots=True)
class CalibrationState:
    """Whether a profile's predictions rest on a measured run of the engine."""

    calibrated: bool
    """True when the compute rate was fitted to a measured run (``calibrate`` on engine
    spans, ``fit_compute`` on a plain iteration); False for presets and microbenchmarks."""
    text: str
    """One plain line for a view: which, and what to do about it."""


CALIBRATED_PREFIXES = ("calibrated", "fitted")
"""How ``HardwareProfile.sources`` marks a compute rate fitted to a run (here and in
plan/profiles_measured.py)."""


def calibration_state(profile: HardwareProfile) -> CalibrationState:
    """Is `profile` calibrated (``CalibrationState``)? Read from its sources."""
    src = dict(profile.sources).get("device_achieved_tflops", "")
    if src.startswith(CALIBRATED_PREFIXES):
        return CalibrationState(True, f"calibrated (profile {profile.name}: compute rate {src})")
    if src.startswith("measured"):
        kind = "measured by microbenchmarks, not yet fitted to a run"
    else:
        kind = "a preset: vendor figures and our estimates"
    return CalibrationState(False, f"not calibrated (profile {profile.name} is {kind}); "
                                   "`superoffload train` calibrates it after its first "
                                   "iterations and saves profile-calibrated.json in the run "
                                   "folder (pass it with --profile)")


def fit_compute(profile: HardwareProfile, shape: ModelShape, plain_iteration_s: float
                ) -> HardwareProfile:
    """A copy of `profile` whose achieved FLOP/s makes the planner's "gpu" schedule (plain
    PyTorch, fused AdamW on the device) take `plain_iteration_s` for `shape`. That schedule is
    serial (compute, validation, the device step), so its time is FLOPs / rate + a rest that
    does not depend on the rate: one simulation gives the rest, the fit is exact."""
    from superoffload.plan.simulator import simulate

    if not plain_iteration_s > 0:
        raise ValueError(f"fit_compute: plain_iteration_s={plain_iteration_s!r}: use the "
                         "measured seconds of one plain iteration (> 0)")
    lane = compute.iteration_compute_s(shape, profile)
    base = simulate(shape, profile, "gpu").iteration_s
    rest = base - lane
    if plain_iteration_s <= rest:
        raise ValueError(f"fit_compute: {plain_iteration_s * 1e3:.1f} ms is less than the "
                         f"non-compute part the profile predicts ({rest * 1e3:.1f} ms): check "
                         "the shape (seq, micro_batch, checkpointing) and the profile")
    return compute.scaled(profile, lane / (plain_iteration_s - rest),
                          f"fitted to a measured plain iteration of {plain_iteration_s * 1e3:.1f} "
                          "ms (calibrate.fit_compute)")
