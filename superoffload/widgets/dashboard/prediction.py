"""The planner's prediction beside a measured run, compared like with like.

A dashboard that follows an engine shows what the planner predicts for the settings in
force: a step function over iterations (a reconfiguration or a new profile starts a step,
`expected.Expected`). Like with like: one optimizer step of `grad_accum_steps` micro-batches
(`sources.predicted_step`), compared with the engine time (the window minus the loop's own
work, `telemetry.vocabulary`). The profile is calibrated to the run (docs/planner.md,
"Accuracy"): an `AutoCalibrator` after the first iterations when the profile is this
machine's measured one, after the run's warm-up (widgets/shared/calibration.py), or `calibrate()` on
demand (`plan.autocal.calibrate_run`);
`Expected.calibrated` says which a prediction used.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from superoffload.widgets.dashboard.expected import Expected
from superoffload.widgets.dashboard.sources import predicted_step, workload
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import Workload
from superoffload.widgets.shared.calibration import after_warm_up
from superoffload.widgets.shared.profile import ProfileChoice


class Predictor:
    """Expected iteration times for a run of `engine` on `shape` (module docstring)."""

    def __init__(self, engine: Any, recorder: Any, shape: Any, profile: ProfileChoice | None, *,
                 calibrate_after: int | None = None, measured_here: bool = False) -> None:
        self.engine, self.recorder, self.shape = engine, recorder, shape
        self.profile = profile
        self.expected: list[Expected] = []
        self.calibration: Any = None
        """The last calibration on this run (`plan.autocal.CalibrationReport`), or None."""
        self._key: Any = None
        self._notes = 0
        self._lock = threading.RLock()
        self.calibrator: Any = self._start_calibrator(calibrate_after, measured_here)
        """An AutoCalibrator on the engine when the profile is this machine's measured one:
        after `calibrate_after` iterations the prediction uses the profile fitted to the run."""

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step: the engine's grad_accum_steps (1 without one)."""
        steps = getattr(getattr(self.engine, "config", None), "grad_accum_steps", 1)
        return int(steps) if isinstance(steps, int) and steps >= 1 else 1

    def workload(self) -> Workload:
        return workload(self.shape, self.profile, self.micro_batches)

    def step_shape(self) -> Any:
        """The shape of one optimizer step: all its micro-batches (what the spans measure)."""
        steps = self.micro_batches
        if self.shape is None or steps == 1:
            return self.shape
        return dataclasses.replace(self.shape, micro_batch=self.shape.micro_batch * steps)

    def update(self, state: DashboardState) -> None:
        """Re-predict when the engine's settings or the profile changed (a new step)."""
        if self.shape is None or self.profile is None or self.engine is None:
            return
        with self._lock:
            config = getattr(self.engine, "config", None)
            key = (repr(config), id(self.profile.profile))
            notes = len(state.reconfigures)
            if config is None or (key == self._key and notes == self._notes):
                return
            # the step starts where the engine's note says the change holds; without a note
            # yet (the config is swapped a moment before the note is written), at the next
            # complete iteration
            start = max(state.complete_through + 1, 0) if self.expected else 0
            if notes > self._notes and self.expected:
                start = state.reconfigures[-1][0]
            self._notes = notes
            # the note of a change already predicted: move its step
            if key == self._key:
                last = self.expected.pop()
                seconds, tflops = last.iteration_s, last.tflops
            else:
                seconds, tflops = predicted_step(self.shape, self.profile.profile, config,
                                                 self.micro_batches)
            self.expected = [e for e in self.expected if e.from_iteration < start]
            self.expected.append(Expected(start, seconds, tflops,
                                          calibrated=self.profile.calibrated))
            self._key = key

    def _start_calibrator(self, after: int | None, measured_here: bool) -> Any:
        from superoffload.runtime import step_listener

        if (not after or self.engine is None or self.shape is None or self.profile is None
                or not measured_here or not step_listener.supported(self.engine)):
            return None
        # after the run's warm-up, shared with a tuner on the same run
        # (widgets/shared/calibration.py)
        calibrator = after_warm_up(self.engine, self.step_shape(), self.profile.profile,
                                   after=after)
        calibrator.on_calibrated(self.use_calibration)
        return calibrator

    def use_calibration(self, report: Any) -> None:
        """Predict with the profile `report` fitted to this run, from the next complete
        iteration on (any thread: the AutoCalibrator calls it in the training thread)."""
        with self._lock:
            self.calibration = report
            first, last = report.iterations
            self.profile = ProfileChoice(report.profile, f"fitted to iterations {first}-{last}")

    def calibrate(self) -> Any:
        """Fit the profile to the run's telemetry now (`plan.autocal.calibrate_run`: the
        compute lane, the CPU step and the links from the recorded spans, the iteration time
        from the engine's `iteration_s`); returns the report."""
        from superoffload.plan.autocal import calibrate_run

        if self.shape is None or self.profile is None or self.recorder is None:
            raise ValueError("LiveDashboard.calibrate needs a run to fit: pass the engine and "
                             "shape=... (the model or a plan.ModelShape) to LiveDashboard")
        times = [(s.iteration, s.value) for s in self.recorder.scalars("iteration_s")][1:]
        if len(times) < 3:
            raise ValueError("LiveDashboard.calibrate: fewer than 3 recorded iterations; "
                             "train a few steps first")
        config = getattr(self.engine, "config", None)
        report = calibrate_run(self.profile.profile, self.step_shape(), config,
                               self.recorder.spans(), times)
        self.use_calibration(report)
        return report
