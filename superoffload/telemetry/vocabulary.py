"""One vocabulary of metrics: every view names, scales and defines a figure from this table.

The CLI summary, the dashboard (status line, legends, axis titles), the HTML report, the
Trainer/Lightning logs (`superoffload/<name>`), TensorBoard (`<group>/<name>`) and the
Perfetto trace's counters all read `METRICS`, so "D2H while moving 0.33 GB/s" means the same
bytes over the same time wherever it is shown, in one unit per quantity (iteration time is
always ms, rates GB/s, shares %). `tests/test_vocabulary.py` checks that every view's names
come from here.

Legend: an iteration's *window* runs from its first device-compute span to the next
iteration's first one (`telemetry.metrics`). *Busy* rates divide by the time a lane was moving
bytes, *wall* rates by the window: a link that moved 1 GB in 10 ms of a 1 s iteration reads
100 GB/s while moving and 1 GB/s per iteration. D2H = gradients out, H2D = weights in.
Over several iterations every figure is *pooled* (`telemetry.window`: the window's totals
divided as one iteration's are), and a view says which iterations it pools.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from superoffload.telemetry.metrics import IterationMetrics, Summary, link_utilisation_pct
from superoffload.telemetry.window import WINDOW_NAMES, window_values


@dataclass(frozen=True, slots=True)
class Metric:
    """One named quantity: the same name, unit and meaning in every view."""

    name: str
    """The key: `superoffload/<name>` in framework logs, `<group>/<name>` in TensorBoard, the
    counter argument in the trace, the column in `DashboardState.series()`."""
    label: str
    """What a person reads ("D2H while moving")."""
    unit: str
    """"ms", "GB/s", "%", "tokens/s", ... ("" for a pure number)."""
    group: str
    """Section (TensorBoard groups tags by it; the report groups charts)."""
    definition: str

    @property
    def tag(self) -> str:
        """TensorBoard tag."""
        return f"{self.group}/{self.name}"

    @property
    def title(self) -> str:
        """Label with its unit: an axis or counter title."""
        return f"{self.label} ({self.unit})" if self.unit else self.label

    def show(self, value: float) -> str:
        """"D2H while moving 0.331 GB/s" (a dash for NaN; "2.29k tokens/s" when the label
        is the unit)."""
        if self.label == self.unit:
            return format_value(value, self.unit)
        return f"{self.label} {format_value(value, self.unit)}"


def format_value(value: float, unit: str) -> str:
    """A number in its unit as a person reads it: 3 significant digits without exponents
    ("37.9 ms", "0.0139 GB/s"), times past a second in seconds or minutes ("1.75 s",
    "2 min 05 s", never "1.75e+03 ms"), k/M/G suffixes for token rates, "-" for NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "%":
        if value < 0.1:
            # a CPU-only "link" is used a fraction of a percent
            return f"{value:.2g} %"
        return f"{value:.1f} %" if value < 10 else f"{value:.0f} %"
    if unit == "count":
        return f"{int(value)}"
    if unit == "ms":
        return format_ms(value)
    if unit in ("tokens/s",):
        for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= div:
                return f"{value / div:.3g}{suffix} {unit}"
    return f"{plain(value)} {unit}".rstrip()


def plain(value: float) -> str:
    """3 significant digits, no exponent between 1e-4 and 1e6 ("1750", "0.0139", "37.9")."""
    size = abs(value)
    if size == 0 or not 1e-4 <= size < 1e6:
        return f"{value:.3g}"
    digits = max(0, 2 - math.floor(math.log10(size)))
    return f"{value:.{digits}f}"


def format_ms(ms: float) -> str:
    """A duration given in ms: "0.452 ms", "37.9 ms", "1.75 s", "2 min 05 s", "3 h 02 min"."""
    if ms < 1000:
        return f"{plain(ms)} ms"
    seconds = ms / 1e3
    if seconds < 60:
        return f"{plain(seconds)} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


_TABLE = (
    # time
    Metric("iteration_ms", "iteration time", "ms", "time",
           "length of the iteration's window (first device-compute span to the next "
           "iteration's first): what one optimizer step costs, framework work included"),
    Metric("engine_ms", "engine time", "ms", "time",
           "the part of the window during which some lane of the engine worked (what the "
           "planner predicts; the rest is the framework's own work: data loading, logging)"),
    Metric("outside_engine_ms", "outside the engine", "ms", "time",
           "the part of the window during which no lane of the engine worked"),
    Metric("exposed_optimizer_ms", "exposed optimizer", "ms", "overlap",
           "optimizer work after backward during which the device did no model compute "
           "(what the next forward waited for; paper §4.2)"),
    # throughput
    Metric("tokens_per_s", "tokens/s", "tokens/s", "throughput",
           "tokens per iteration (all micro-batches of the step) / iteration time"),
    Metric("tflops", "TFLOP/s", "TFLOP/s", "throughput",
           "executed FLOPs per iteration (recompute included) / iteration time"),
    # link, per direction, busy vs wall
    Metric("d2h_gbps_busy", "D2H while moving", "GB/s", "link",
           "gradient bytes sent to the host / time the D2H lane was moving them"),
    Metric("h2d_gbps_busy", "H2D while moving", "GB/s", "link",
           "weight bytes sent to the device / time the H2D lane was moving them"),
    Metric("d2h_gbps_wall", "D2H per iteration", "GB/s", "link",
           "gradient bytes sent to the host / iteration time"),
    Metric("h2d_gbps_wall", "H2D per iteration", "GB/s", "link",
           "weight bytes sent to the device / iteration time"),
    Metric("d2h_link_use_pct", "D2H link use", "%", "link",
           "D2H per iteration / the planner's D2H rate (the profile's: a preset's peak, this "
           "machine's best measured copy, or a rate fitted to a run), in percent"),
    Metric("h2d_link_use_pct", "H2D link use", "%", "link",
           "H2D per iteration / the planner's H2D rate (as for D2H), in percent"),
    # overlap
    Metric("cpu_step_hidden_pct", "CPU step hidden", "%", "overlap",
           "CPU optimizer time that ran while the device worked / all CPU optimizer time of "
           "the iterations (no value when they had no CPU work)"),
    Metric("cpu_busy_pct", "CPU optimizer busy", "%", "overlap",
           "time the CPU optimizer lane worked inside the window / iteration time"),
    Metric("device_idle_pct", "device idle", "%", "overlap",
           "share of the window the device neither computed nor stepped (waits count as idle)"),
    # training
    Metric("loss", "loss", "nats", "train",
           "the engine's mean loss of the iteration's micro-batches"),
    Metric("grad_norm", "grad norm", "", "train", "global gradient norm before clipping"),
    Metric("loss_scale", "loss scale", "", "train", "fp16 dynamic loss scale in force"),
    Metric("lr", "learning rate", "", "train", "learning rate of the first parameter group"),
    Metric("ratio", "ratio", "", "settings", "share of the buckets stepped on the CPU, in force"),
    Metric("speculating", "speculating", "", "stv",
           "1 when the step's CPU buckets were stepped before validation (STV), else 0"),
    Metric("weights_flow", "weight-flow", "", "settings",
           "1 when the weights streamed in from the host (weight-flow), 0 when stationary"),
    Metric("device_weight_gb", "device weights", "GB", "memory",
           "bytes of weights held on the device (peak of the iteration)"),
    # speculation-then-validation
    Metric("rollbacks", "bucket rollbacks", "count", "stv",
           "buckets rolled back after validation (per iteration in series, run total in logs)"),
    Metric("replays", "replays", "count", "stv",
           "buckets replayed with the clipped gradient "
           "(per iteration in series, run total in logs)"),
    Metric("clipped_steps", "clipped steps", "count", "stv",
           "optimizer steps that clipped (run total)"),
    Metric("skipped_steps", "skipped steps", "count", "stv",
           "steps skipped on a non-finite gradient (run total)"),
    Metric("window_iterations", "iterations pooled", "count", "time",
           "complete iterations a logged figure pools (those since the previous log)"),
    # memory
    Metric("host_mem_gb", "host memory", "GB", "memory",
           "the engine's host_mem_bytes scalar, else this process's resident memory"),
    Metric("device_mem_gb", "device memory", "GB", "memory",
           "the engine's device_mem_bytes scalar, else the CUDA allocator's count"),
)

METRICS: dict[str, Metric] = {m.name: m for m in _TABLE}
"""Every metric by name, in display order."""

PER_ITERATION = WINDOW_NAMES
"""What `iteration_values` derives from spans alone (tokens/s, TFLOP/s and link use need
the workload or the link's reference rate)."""

ENGINE_SCALARS: dict[str, tuple[str, float]] = {
    "loss": ("loss", 1.0),
    "iteration_s": ("iteration_ms", 1e3),
    "grad_norm": ("grad_norm", 1.0),
    "loss_scale": ("loss_scale", 1.0),
    "ratio": ("ratio", 1.0),
    "lr": ("lr", 1.0),
    "host_mem_bytes": ("host_mem_gb", 1e-9),
    "device_weight_bytes": ("device_weight_gb", 1e-9),
    "device_mem_bytes": ("device_mem_gb", 1e-9),
}
"""The engine's recorder scalars (runtime/stv.py, runtime/engine.py) in this vocabulary:
(name, factor from the engine's unit). A scalar not listed keeps its own name."""


def metric(name: str) -> Metric:
    """The metric called `name`; a ValueError lists the known names."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)}") from None


def engine_scalar(name: str, value: float) -> tuple[str, float]:
    """(vocabulary name, value in its unit) of an engine scalar (`ENGINE_SCALARS`)."""
    to, factor = ENGINE_SCALARS.get(name, (name, 1.0))
    return to, value * factor


def iteration_values(m: IterationMetrics) -> dict[str, float]:
    """The `PER_ITERATION` metrics of one iteration, in their units: the window of one
    iteration (`telemetry.window.window_values`; NaN where undefined: a direction that moved
    no bytes has no rate, an iteration without CPU work hides none)."""
    return window_values([m])


def workload_values(iteration_ms: float, *, tokens_per_iteration: float | None = None,
                    flops_per_iteration: float | None = None) -> dict[str, float]:
    """tokens/s and TFLOP/s of an iteration that took `iteration_ms` (only those given)."""
    out: dict[str, float] = {}
    seconds = iteration_ms / 1e3
    if tokens_per_iteration:
        out["tokens_per_s"] = tokens_per_iteration / seconds if seconds > 0 else math.nan
    if flops_per_iteration:
        out["tflops"] = flops_per_iteration / seconds / 1e12 if seconds > 0 else math.nan
    return out


def link_use_values(d2h_gbps_wall: float, h2d_gbps_wall: float, *, d2h_peak_gbps: float | None,
                    h2d_peak_gbps: float | None) -> dict[str, float]:
    """Link use in % of each direction's peak (only the directions with a known peak)."""
    out: dict[str, float] = {}
    if d2h_peak_gbps:
        out["d2h_link_use_pct"] = link_utilisation_pct(d2h_gbps_wall, d2h_peak_gbps)
    if h2d_peak_gbps:
        out["h2d_link_use_pct"] = link_utilisation_pct(h2d_gbps_wall, h2d_peak_gbps)
    return out


def summary_values(s: Summary) -> dict[str, float]:
    """A run's pooled figures (`metrics.Summary`, over its window) and totals (over the
    whole run) in the vocabulary's names and units."""
    return {
        "iteration_ms": s.wall_s * 1e3,
        "exposed_optimizer_ms": s.exposed_optimizer_s * 1e3,
        "d2h_gbps_busy": s.d2h_gbps_busy if s.d2h_bytes_total else math.nan,
        "h2d_gbps_busy": s.h2d_gbps_busy if s.h2d_bytes_total else math.nan,
        "d2h_gbps_wall": s.d2h_gbps_wall,
        "h2d_gbps_wall": s.h2d_gbps_wall,
        "cpu_step_hidden_pct": 100.0 * s.cpu_overlap_frac,
        "cpu_busy_pct": 100.0 * s.cpu_busy_frac,
        "device_idle_pct": 100.0 * s.device_idle_frac,
        "rollbacks": float(s.rollbacks_total),
        "replays": float(s.replays_total),
    }


def describe_values(values: Mapping[str, Any], names: tuple[str, ...] | list[str]) -> str:
    """"iteration time 33 ms · D2H while moving 2 GB/s" for the `names` present in `values`."""
    return " · ".join(METRICS[n].show(float(values[n])) for n in names if n in values)
