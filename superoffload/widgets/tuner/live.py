"""What the tuner does with a live engine: Apply measured as an interleaved A/B
(runtime/ab_trial.py) beside the planner's predicted change, and the planner calibrated by
itself after the engine's first iterations (runtime/calibrator.py). Functions over the tuner's
public state; the tuner calls them."""

from __future__ import annotations

from typing import Any

from superoffload.runtime import step_listener
from superoffload.widgets.shared.calibration import after_warm_up
from superoffload.widgets.tuner.core import predict


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


def extend_trial(tuner: Any, measured: Any, pairs: int) -> Any:
    """More pairs of the change `measured` (an ``ABResult``): the old settings back in force
    first (A comes first), then `pairs` alternations ending on the new ones; its result goes
    to ``tuner.record_trial``, which pools it with `measured`."""
    from superoffload.runtime.ab_trial import ABTrial

    old = {k: a for k, (a, _b) in measured.changes.items()}
    new = {k: b for k, (_a, b) in measured.changes.items()}
    tuner.engine.reconfigure(**old)
    return ABTrial(tuner.engine, old, new, block=measured.block, pairs=pairs,
                   predicted_change=measured.predicted_change, on_done=tuner.record_trial).start()


def start_calibrator(tuner: Any, after: int | None, measured_here: bool) -> Any:
    """An AutoCalibrator on the tuner's engine, or None: no engine, no step hooks, `after`
    None, or a profile that is not this machine's measured one (a preset describes another
    machine: fitting it to this one would be wrong)."""
    engine = tuner.engine
    if engine is None or not after or not step_listener.supported(engine):
        return None
    if not (measured_here or tuner.choice.of_this_machine):
        return None
    # after the run's warm-up, shared with a dashboard on the same run
    # (widgets/shared/calibration.py)
    calibrator = after_warm_up(engine, tuner.shape, tuner.profile, after=after)
    calibrator.on_calibrated(tuner.use_calibration)
    return calibrator


def calibration_lines(tuner: Any) -> list[str]:
    """What calibration changed (plain text): the planner before and after it was fitted to
    this run, or what it is waiting for."""
    report = tuner.calibrator.report if tuner.calibrator is not None else None
    if tuner.calibrator is None:
        return ["no calibration: the tuner has no engine whose run it could fit, or its profile "
                "is not this machine's"]
    if report is None:
        after = getattr(tuner.calibrator, "after", "the first")
        at = getattr(tuner.engine, "iteration", "?")
        return [f"waiting for calibration: once the run has warmed up, the planner fits its "
                f"profile to {after} steady iterations (the engine is at iteration {at}); this "
                "line updates then"]
    return [report.line(),
            f"before: predicted {report.before_s * 1e3:.2f} ms vs measured "
            f"{report.measured_s * 1e3:.2f} ms ({report.error_before:+.0%}); "
            f"after: {report.after_s * 1e3:.2f} ms ({report.error_after:+.0%})"]


def show_calibration(tuner: Any) -> None:
    """A live view of `calibration_lines` in the running cell: it changes when the planner
    calibrates, and is frozen in place with the tuner when the run ends (outside a notebook:
    printed once)."""
    import html

    from superoffload.widgets.shared import env as _env
    from superoffload.widgets.shared import slots as snap

    if not (_env.in_notebook() and _env.has_module("ipywidgets")):
        print("\n".join(calibration_lines(tuner)))
        return
    import ipywidgets as w

    def text() -> str:
        return "<br>".join(html.escape(line) for line in calibration_lines(tuner))

    label = w.HTML(value=text(), layout=w.Layout(width="auto"))
    label.add_class("so-calibration")
    out = snap.LiveOutput("calibration", label, lambda: calibration_lines(tuner),
                          css_class="so-calibration-snapshot")
    out.show()
    tuner.live_outputs.append(out)
    if tuner.calibrator is not None:
        tuner.calibrator.on_calibrated(lambda _report: setattr(label, "value", text()))
    if tuner.run_state is not None and tuner.run_state.ended:
        out.freeze()
