"""What the tuner does with a live engine (issue 18): Apply measured as an interleaved A/B
(runtime/ab_trial.py) beside the planner's predicted change, and the planner calibrated by
itself after the engine's first iterations (runtime/autocal.py). Functions over the tuner's
public state; the tuner calls them."""

from __future__ import annotations

from typing import Any

from superoffload.runtime import step_listener
from superoffload.widgets.tuner_core import predict


def start_trial(tuner: Any, changes: dict[str, Any]) -> Any:
    """An ABTrial of the engine's values of `changes` against `changes`, with the planner's
    predicted change; its result goes to ``tuner.record_trial``."""
    from superoffload.runtime.ab_trial import ABTrial

    current = tuner.engine.config
    old = {k: getattr(current, k) for k in changes}
    before = predict(tuner.shape, tuner.profile, current).iteration_s
    after = predict(tuner.shape, tuner.profile, current.replace(**changes)).iteration_s
    return ABTrial(tuner.engine, old, changes, block=tuner.ab_block, pairs=tuner.ab_pairs,
                   predicted_change=after / before - 1.0, on_done=tuner.record_trial).start()


def start_calibrator(tuner: Any, after: int | None, measured_here: bool) -> Any:
    """An AutoCalibrator on the tuner's engine, or None: no engine, no step hooks, `after`
    None, or a profile that is not this machine's measured one (a preset describes another
    machine: fitting it to this one would be wrong)."""
    engine = tuner.engine
    if engine is None or not after or not step_listener.supported(engine):
        return None
    if not (measured_here or tuner.choice.name.startswith("local-")):
        return None
    from superoffload.runtime.autocal import AutoCalibrator

    calibrator = AutoCalibrator(engine, tuner.shape, tuner.profile, after=after).start()
    calibrator.on_calibrated(tuner.use_calibration)
    return calibrator
