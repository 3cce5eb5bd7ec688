"""Calibrate the planner by itself after the first iterations of a training run
(docs/planner.md, "Calibration on this machine"): the glue between a running engine and
plan/autocal.py.

``AutoCalibrator(engine, shape, profile).start()`` listens after every optimizer step
(runtime/step_listener.py), lets `skip` iterations warm up, and after `after` more reads the
engine's public telemetry (``engine.telemetry.spans()``, its ``iteration_s`` scalars) and
fits the profile: ``report`` holds before / after / measured, a telemetry note records it,
``save_to`` keeps the calibrated profile as JSON (``plan --profile`` and the tuner take it),
a window too noisy to be a steady state (``MAX_SPREAD``, a busy shared host) is passed over
for the next one (up to ``attempts``),
and ``on_calibrated`` callbacks (the tuner, a dashboard) switch to it. It runs once, in the
training thread between two iterations (a fit and two simulations: milliseconds), and
never raises into training: a failure is kept in ``error``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from superoffload.plan.autocal import NOISY_SPREAD, CalibrationReport, calibrate_run, spread
from superoffload.runtime import step_listener

DEFAULT_AFTER = 10
"""Iterations measured before calibrating (after the warm-up)."""
DEFAULT_SKIP = 3
"""Warm-up iterations not measured (allocation, thread start, the first bucket plans)."""
MAX_SPREAD = NOISY_SPREAD
"""A window whose iteration times spread more ((p90 - p10) / median) is not a steady state
(a busy shared host): the calibrator tries the next window, up to `attempts` windows, then
calibrates on the last one and the report line shows the spread."""


class AutoCalibrator:
    """Calibrate once, after `skip` + `after` iterations of `engine` (module docstring)."""

    def __init__(self, engine: Any, shape: Any, profile: Any, *, after: int = DEFAULT_AFTER,
                 skip: int = DEFAULT_SKIP, save_to: str | Path | None = None,
                 attempts: int = 3, max_spread: float = MAX_SPREAD) -> None:
        if not isinstance(after, int) or after < 2:
            raise ValueError(f"AutoCalibrator.after={after!r}: use a whole number >= 2")
        if not isinstance(skip, int) or skip < 0:
            raise ValueError(f"AutoCalibrator.skip={skip!r}: use a whole number >= 0")
        self.engine, self.shape, self.profile = engine, shape, profile
        self.after, self.skip = after, skip
        self.attempts, self.max_spread = max(1, int(attempts)), float(max_spread)
        self.save_to = Path(save_to) if save_to is not None else None
        self.report: CalibrationReport | None = None
        self.error: str | None = None
        self.callbacks: list[Callable[[CalibrationReport], None]] = []
        self._start = -1
        self._passed: tuple[int, int] | None = None
        """The last window passed over as noisy (calibrated on at stop() if no other came)."""
        self._leave: Callable[[], None] | None = None
        self._done = threading.Event()

    def start(self) -> AutoCalibrator:
        self._start = int(self.engine.iteration)
        self._leave = step_listener.subscribe(self.engine, self.on_step)
        return self

    def on_calibrated(self, fn: Callable[[CalibrationReport], None]) -> None:
        """Call `fn(report)` when it calibrates (at once when it has)."""
        if self.report is not None:
            fn(self.report)
        else:
            self.callbacks.append(fn)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> CalibrationReport | None:
        self._done.wait(timeout_s)
        return self.report

    def stop(self) -> None:
        """Stop listening; a run that ends before a steady window calibrates on the last
        noisy one (its report line says the host was busy)."""
        if self._leave is not None:
            self._leave()
            self._leave = None
        if not self._done.is_set() and self._passed is not None:
            self._finish(*self._passed)

    def on_step(self) -> None:
        """After each step, in the training thread; never raises."""
        if self._done.is_set():
            return
        first = self._start + self.skip
        last = first + self.after - 1
        if int(self.engine.iteration) <= last:
            return
        self.attempts -= 1
        if self.attempts > 0 and spread(self._times(first, last)) > self.max_spread:
            self._passed = (first, last)
            # not steady: measure the next window
            self._start = last + 1 - self.skip
            return
        self._finish(first, last)

    def _finish(self, first: int, last: int) -> None:
        try:
            self._calibrate(first, last)
        except Exception as exc:  # calibration must never break training
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()
            self.stop()

    def _times(self, first: int, last: int) -> list[float]:
        return [t for _, t in self._pairs(first, last)]

    def _pairs(self, first: int, last: int) -> list[tuple[int, float]]:
        return [(s.iteration, s.value) for s in self.engine.telemetry.scalars("iteration_s")
                if first <= s.iteration <= last]

    def _calibrate(self, first: int, last: int) -> None:
        telemetry = self.engine.telemetry
        spans = [s for s in telemetry.spans() if first <= s.iteration <= last]
        times = self._pairs(first, last)
        threads = getattr(getattr(self.engine, "schedule", None), "threads", None)
        report = calibrate_run(self.profile, self.shape, self.engine.config, spans, times,
                               cpu_threads=threads)
        self.report = report
        telemetry.note(int(self.engine.iteration), report.line())
        if self.save_to is not None:
            self.save_to.parent.mkdir(parents=True, exist_ok=True)
            self.save_to.write_text(json.dumps(report.profile.to_dict(), indent=1, default=str))
        for fn in self.callbacks:
            fn(report)
