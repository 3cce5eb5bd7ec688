"""Calibrate the planner on the first iterations of a real run (docs/planner.md). Pure.

The engine's telemetry of a few steady iterations (spans per lane, the step-to-step
iteration time) is the best description of this machine for this model: ``calibrate_run``
fits the profile to them (``plan.calibrate``: the compute lane scaled to its measured busy
time, the CPU step, the links) and reports the prediction before and after beside the
measured median, so a view can say "calibrated" and how far off the uncalibrated figure
was. runtime/calibrator.py runs it by itself after N iterations of a training run.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from superoffload.plan.calibrate import calibrate
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.techniques import Techniques
from superoffload.telemetry.events import Span

NOISY_SPREAD = 0.5
"""Iteration times spreading more than this ((p90 - p10) / median) are not a steady state."""


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """What one calibration did."""

    iterations: tuple[int, int]
    """First and last iteration measured."""
    measured_s: float
    """Median step-to-step iteration time over them."""
    spread: float
    """(p90 - p10) / median of those times: how steady the run was."""
    before_s: float
    """The uncalibrated profile's prediction for the run's settings."""
    after_s: float
    """The calibrated profile's prediction for the same settings."""
    profile: HardwareProfile
    """The calibrated profile (name ends in "-calibrated")."""

    @property
    def error_before(self) -> float:
        return self.before_s / self.measured_s - 1.0

    @property
    def error_after(self) -> float:
        return self.after_s / self.measured_s - 1.0

    def line(self) -> str:
        noisy = " -- a busy host: take it with care" if self.spread > NOISY_SPREAD else ""
        return (f"planner calibrated on iterations {self.iterations[0]}-{self.iterations[1]}: "
                f"measured {self.measured_s * 1e3:.2f} ms/iteration (median, spread "
                f"{self.spread:.0%}); predicted {self.before_s * 1e3:.2f} ms before "
                f"({self.error_before:+.0%}), {self.after_s * 1e3:.2f} ms after "
                f"({self.error_after:+.0%}) on profile {self.profile.name}{noisy}")

    def to_dict(self) -> dict[str, Any]:
        return {"iterations": list(self.iterations), "measured_s": self.measured_s,
                "spread": self.spread, "before_s": self.before_s, "after_s": self.after_s,
                "error_before": self.error_before, "error_after": self.error_after,
                "profile": self.profile.name, "line": self.line()}


def spread(values: Sequence[float]) -> float:
    """(p90 - p10) / median (0 for fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    qs = statistics.quantiles(values, n=10, method="inclusive")
    return (qs[-1] - qs[0]) / statistics.median(values)


def calibrate_run(profile: HardwareProfile, shape: ModelShape, config: Any,
                  spans: Iterable[Span], iteration_s: Sequence[tuple[int, float]], *,
                  cpu_threads: int | None = None) -> CalibrationReport:
    """Fit `profile` to the spans and step-to-step times (iteration, seconds) of a run of
    `shape` with OffloadConfig `config`; report before, after and measured. The spans should
    cover the same iterations (``plan.calibrate`` drops the first of several)."""
    from superoffload.plan.simulator import simulate

    if not iteration_s:
        raise ValueError("calibrate_run: no iteration times to calibrate on")
    spans = list(spans)
    tech = Techniques(rollback_rate=0.0)
    times = [t for _, t in iteration_s]
    cal = calibrate(profile, spans, shape, cpu_threads=cpu_threads)
    before = simulate(shape, profile, config=config, techniques=tech).iteration_s
    after = simulate(shape, cal, config=config, techniques=tech).iteration_s
    its = [i for i, _ in iteration_s]
    return CalibrationReport((min(its), max(its)), statistics.median(times), spread(times),
                             before, after, cal)
