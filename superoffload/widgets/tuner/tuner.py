"""`OffloadTuner`: controls for every offload setting with the planner's prediction, live.

    tuner = OffloadTuner(plan.ModelShape(...), "gh200")               # what-if, no engine
    tuner = OffloadTuner(model, engine=engine, seq=64, micro_batch=8)  # this machine, live
    tuner                                                              # shows the controls

Every control change re-runs `plan.simulate` off the kernel's main thread, once the
controls have been still for `debounce_s`, and rewrites the prediction table. The profile is
this machine's measured one unless another is given, and the title says which. With an engine
attached, "Apply to engine" sends the changed fields to `engine.reconfigure(...)` (in force from
the next iteration); it is disabled when nothing can take the change (no engine, an engine
that cannot reconfigure, nothing changed). One tuner per display: when the run ends (or the
kernel exits) its controls are replaced IN PLACE by a static snapshot of the settings, the
prediction and the status, so a saved notebook shows the tuner once, readable.

Past 400 lines: one controller, whose methods are the notebook API (set, apply, measure,
display); its pure parts (core.py, changes.py), its view (controls.py) and its live A/B and
calibration (live.py) are modules of their own already.
"""

from __future__ import annotations

import contextlib
import html
import itertools
import os
from pathlib import Path
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.runtime import step_listener
from superoffload.telemetry.abtest import combine, lengthen, resolves
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.debounce import Executor, Inline, LatestOnly
from superoffload.widgets.shared.profile import (
    ProfileChoice,
    describe_choice,
    resolve_profile,
    to_shape,
)
from superoffload.widgets.shared.runstate import RunState
from superoffload.widgets.tuner import controls, live
from superoffload.widgets.tuner.changes import change_rows, ratio_curve
from superoffload.widgets.tuner.core import (
    CONTROL_FIELDS,
    Prediction,
    apply_block_reason,
    baseline_result,
    bucket_options,
    engine_changes,
    predict,
    prediction_text,
    reconfigurable_fields,
    setting_notes,
)


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


class OffloadTuner:
    """Sliders and toggles over the tuned OffloadConfig fields, a prediction, an apply button."""

    def __init__(self, shape_or_model: Any, profile: Any = None, engine: Any = None, *,
                 config: OffloadConfig | None = None, seq: int | None = None,
                 micro_batch: int = 1, preview: Any = None, compare_baseline: bool = True,
                 debounce_s: float = 0.2, measure_apply: bool = True, ab_block: int = 4,
                 ab_pairs: int = 6, calibrate_after: int | None = 10) -> None:
        self.shape = to_shape(shape_or_model, seq=seq, micro_batch=micro_batch)
        self.choice = resolve_profile(profile)
        self.profile = self.choice.profile
        self.engine = engine
        base = config or (engine.config if engine is not None else OffloadConfig())
        if not isinstance(base, OffloadConfig):
            raise TypeError(f"config={base!r} must be a superoffload.OffloadConfig")
        self.base_config = base.replace()  # a validated copy the controls start from
        self.preview = preview
        self.values: dict[str, Any] = {name: getattr(self.base_config, name)
                                       for name in CONTROL_FIELDS}
        self._derived_threads = self.values["cpu_threads"] is None
        if self._derived_threads:  # the slider needs a number: what cpu_cores_frac gives here
            cores = int(getattr(self.profile, "cpu_cores", os.cpu_count() or 1))
            self.values["cpu_threads"] = max(1, round(cores * self.base_config.cpu_cores_frac))
        self._shown_default_threads = self.values["cpu_threads"]
        self.baseline = baseline_result(self.shape, self.profile) if compare_baseline else None
        """The ZeRO-Offload simulation the prediction is compared with (None: not compared)."""
        self.prediction: Prediction | None = None
        self.prediction_line = ""
        self.run_state: RunState | None = None
        self.status_line = ("no engine attached (what-if mode)" if engine is None
                            else "not applied yet")
        self.applied: list[dict[str, Any]] = []
        self.measure_apply = measure_apply
        """Apply measures the change as an interleaved A/B (runtime/ab_trial.py) when the
        engine takes step hooks; False: reconfigure at once, unmeasured."""
        self.ab_block, self.ab_pairs = ab_block, ab_pairs
        self.trial: Any = None
        """The A/B of the last Apply (``ABTrial``), while and after it runs."""
        self.ab_results: list[Any] = []
        """Every finished A/B (``telemetry.abtest.ABResult``), oldest first."""
        self.measured: Any = None
        """The last change's measurement, every trial of it pooled (``abtest.combine``)."""
        self._extending = False
        self.changes: list[Any] = []
        """``changes.ChangeRow`` per control that differs from the settings in force."""
        self.curve: list[tuple[float, float | None]] = []
        """Predicted seconds over the ratio (``changes.ratio_curve``)."""
        self._sent: dict[str, Any] = {}
        self.controls: dict[str, Any] = {}
        self._seq = itertools.count()
        self._latest = 0
        self._quiet = False
        self.live_outputs: list[snap.LiveOutput] = []
        """Where the controls are shown; each is frozen in place into the snapshot when the
        run ends or the kernel exits (a reopened notebook shows it, not "model not found")."""
        # the widgets `controls.build_controls` makes (None without ipywidgets)
        self.notes_html: Any = None
        self.prediction_html: Any = None
        self.apply_button: Any = None
        self.measure_button: Any = None
        self.status_html: Any = None
        self.widget: Any = controls.build_controls(self) if _env.has_module("ipywidgets") else None
        # Debounced only behind a widget: a held arrow key sends dozens of values and only the
        # last is worth predicting; without one (scripts, tests) each prediction is inline.
        self.executor: Executor = Inline()
        if self.widget is not None and debounce_s > 0:
            self.executor = LatestOnly(debounce_s)
        self._show(*self._predict(self.config))
        self.calibrator: Any = live.start_calibrator(self, calibrate_after, profile is None)
        """The AutoCalibrator on the attached engine (None: none); when it has run the tuner
        predicts with its profile (widgets/tuner/live.py)."""

    def use_calibration(self, report: Any) -> None:
        """The engine ran long enough: predict with the profile fitted to it."""
        self.choice = ProfileChoice(report.profile, f"calibrated on this run: {report.line()}")
        self.profile = report.profile
        if self.baseline is not None:  # like with like: ZeRO-Offload on the same profile
            self.baseline = baseline_result(self.shape, self.profile)
        self._show(*self._predict(self.config))

    # ----------------------------------------------------------------- state
    @property
    def baseline_s(self) -> float | None:
        """The baseline's seconds per iteration (None: not compared)."""
        return None if self.baseline is None else float(self.baseline.iteration_s)

    @property
    def config(self) -> OffloadConfig:
        """The OffloadConfig the controls describe now."""
        values = dict(self.values)
        # a slider left at the derived default keeps deriving it from cpu_cores_frac (None)
        if self._derived_threads and values["cpu_threads"] == self._shown_default_threads:
            values["cpu_threads"] = None
        return self.base_config.replace(**values)

    def set(self, **values: Any) -> Prediction:
        """Set controls by field name (as a user would); returns the new prediction (computed
        in this thread, so the caller reads it at once)."""
        unknown = sorted(set(values) - set(CONTROL_FIELDS))
        if unknown:
            raise ValueError(f"OffloadTuner.set: unknown control(s) {unknown}; known: "
                             f"{list(CONTROL_FIELDS)}")
        self.base_config.replace(**{**self.values, **values})  # validate before touching anything
        # quiet: no observer queues a prediction per field; one is made below, in this thread
        self._quiet = True
        try:
            for name, value in values.items():
                self.values[name] = value
                control = self.controls.get(name)
                if control is None:
                    continue
                # a dropdown rejects a value it does not list: add it to the bucket choices
                if name == "bucket_bytes" and value not in dict(control.options).values():
                    merged = set(bucket_options(value)) | {tuple(o) for o in control.options}
                    control.options = sorted(merged, key=lambda o: o[1])
                control.value = value
        finally:
            self._quiet = False
        self._latest = next(self._seq)
        self._show(*self._predict(self.config))
        assert self.prediction is not None
        return self.prediction

    def set_run_state(self, state: RunState) -> None:
        """Told by the trainer: the status line and Apply follow the run; a run that ends
        ends the A/B in progress with the new settings in force."""
        self.run_state = state
        if state.ended and self.trial is not None and not self.trial.done:
            self.trial.cancel(f"stopped: the run {state.value} before the A/B finished")
            self.status_line = f"{self.trial.error}; the new settings are in force"
        self._show_status()
        if state.ended:  # display the tuner again for live controls
            for out in self.live_outputs:
                out.freeze()

    def _live_changes(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.engine is None:
            return {}, {}
        current = self.engine.config
        if self.trial is not None and not self.trial.done:
            current = current.replace(**self.trial.new)  # what the A/B leaves in force
        # forget what the engine has taken; what it has not yet taken still counts as sent
        self._sent = {k: v for k, v in self._sent.items() if getattr(current, k) != v}
        target = current.replace(**self._sent) if self._sent else current
        return engine_changes(target, self.config, reconfigurable_fields(self.engine))

    def apply_blocked(self) -> str | None:
        """Why Apply is disabled now (None: enabled)."""
        fields = frozenset() if self.engine is None else reconfigurable_fields(self.engine)
        closed = bool(getattr(self.engine, "closed", False))
        reason = apply_block_reason(self.engine, fields, closed)
        if reason is None and not self._live_changes()[0]:
            return "nothing to apply: the controls match the engine's settings"
        return reason

    def apply(self, *, measure: bool | None = None) -> dict[str, Any]:
        """Send the changed settings to the attached engine (applied between iterations).
        `measure` (default `measure_apply`): as an interleaved A/B -- old and new settings
        alternate for `ab_pairs` pairs of `ab_block` iterations, then the new ones stay --
        whose result (median change, confidence interval, "within noise", the planner's
        predicted change) lands in `ab_results`, the status line and the run's telemetry."""
        if self.engine is None:
            raise ValueError("OffloadTuner.apply: no engine attached; "
                             "pass engine=... to OffloadTuner")
        changes, restart = self._live_changes()
        iteration = getattr(self.engine, "iteration", "?")
        later = "; needs a restart: " + _pairs(restart) if restart else ""
        measure = self.measure_apply if measure is None else measure
        if not changes:
            self.status_line = f"nothing to apply at iteration {iteration}{later}"
        else:
            try:
                if measure and step_listener.supported(self.engine):
                    self._extending = False  # a new change: its own measurement
                    self.trial = live.start_trial(self, changes)
                else:
                    self.engine.reconfigure(**changes)
            except (ValueError, TypeError) as exc:
                self.status_line = f"engine refused {changes}: {exc}"
                self._show_status()
                raise
            self.applied.append(dict(changes))
            self._sent.update(changes)
            when = "in force from the next iteration"
            # a paused or ended run has no next iteration yet: the change waits for one
            if self.run_state is not None and self.run_state is not RunState.RUNNING:
                when = "training is not running: it takes effect at the next iteration trained"
            self.status_line = f"applied {_pairs(changes)} at iteration {iteration} ({when}){later}"
            if self.trial is not None and not self.trial.done and self.trial.new == changes:
                self.status_line += (f"; measuring it as an A/B: old and new settings "
                                     f"alternate, {self.ab_pairs} pairs of {self.ab_block} "
                                     "iterations, then the new ones stay")
        self._show_status()
        return changes

    def record_trial(self, trial: Any) -> None:
        """In the training thread, when an A/B ends with a result: the measurement of the
        change (pooled with the earlier trials of it when "Measure longer" ran one), and
        whether measuring longer can tell the predicted change from no change."""
        self.ab_results.append(trial.result)
        extends = self._extending and self.measured is not None
        self.measured = combine([self.measured, trial.result]) if extends else trial.result
        self._extending = False
        more, why = lengthen(self.measured)
        self.status_line = f"measured: {self.measured.line()}"
        # say how much longer only while the interval cannot tell the change from none
        if not resolves(self.measured):
            self.status_line += f"; {why}"
        if self.widget is not None:
            self.measure_button.disabled = more == 0
            self.measure_button.tooltip = why
        self._show_status()

    def measure_longer(self) -> Any:
        """Run more pairs of the last measured change (old settings back first, then the
        alternation, the new ones left in force), as many as `abtest.lengthen` estimates
        will tell the predicted change from no change; the result pools every pair. Returns
        the trial, or None (with the reason in the status line) when it cannot resolve."""
        if self.engine is None or self.measured is None:
            raise ValueError("measure_longer: no measured change yet (Apply a change first)")
        more, why = lengthen(self.measured)
        if more == 0:
            self.status_line = f"measured: {self.measured.line()}; {why}"
            self._show_status()
            return None
        self._extending = True
        self.trial = live.extend_trial(self, self.measured, more)
        block = self.measured.block
        self.status_line = f"measuring longer: {more} more pairs of {block} iterations"
        if self.widget is not None:
            self.measure_button.disabled = True
        self._show_status()
        return self.trial

    def measure_longer_from_button(self) -> None:
        with contextlib.suppress(ValueError, TypeError):  # the status line says why
            self.measure_longer()

    def show_calibration(self) -> None:
        """Show what calibration changed, live: updated when the planner fits its profile to
        the run, frozen with the tuner at the run's end (`live.show_calibration`)."""
        live.show_calibration(self)

    def close(self) -> None:
        """Stop the prediction worker thread."""
        self.executor.close()

    # ----------------------------------------------------------------- predicting
    def _predict(self, config: OffloadConfig | None) -> tuple[Prediction | None, str, Any, Any]:
        """The planner's answer for `config` (any thread): prediction, its line, a simulation
        and (change rows, ratio curve), which only `_show` stores."""
        if config is None:
            return None, self.prediction_line, None, None
        pred = predict(self.shape, self.profile, config, baseline=self.baseline)
        in_force = self.engine.config if self.engine is not None else self.base_config
        compared = (change_rows(self.shape, self.profile, in_force, config, CONTROL_FIELDS),
                    ratio_curve(self.shape, self.profile, config))
        sim = None
        if self.preview is not None:
            from superoffload import plan

            sim = plan.simulate(self.shape, self.profile, system="superoffload", config=config)
        return pred, prediction_text(pred), sim, compared

    def on_control(self, change: dict[str, Any]) -> None:
        """A control moved (the widgets' observer): predict the new setting off this thread."""
        owner = change["owner"]
        name = next(n for n, c in self.controls.items() if c is owner)
        self.values[name] = change["new"]
        if self._quiet:
            return
        try:
            config = self.config
        except ValueError as exc:
            self._show(None, f"invalid setting: {exc}", None)
            return
        # numbered so that only the newest setting's answer is shown (`_on_prediction`)
        seq = self._latest = next(self._seq)
        if self.widget is not None:
            self.prediction_html.add_class("so-tuner-pending")
        future = self.executor.submit(lambda: self._predict(config))
        future.add_done_callback(lambda f: self._on_prediction(seq, f))

    def _on_prediction(self, seq: int, future: Any) -> None:
        if future.cancelled() or seq != self._latest:
            return  # a newer setting is on its way
        exc = future.exception()
        if exc is not None:
            self._show(None, f"the planner failed on this setting: {exc}", None)
            return
        self._show(*future.result())

    def _show(self, pred: Prediction | None, line: str, sim: Any, compared: Any = None) -> None:
        if pred is not None:  # kept here, not in the worker: a superseded answer never lands
            self.prediction, (self.changes, self.curve) = pred, compared
        self.prediction_line = line
        if sim is not None and self.preview is not None:
            self.preview.show_simulation(sim, profile=self.profile)
        if self.widget is not None:
            self.prediction_html.value = self.render_prediction(pred, line)
            self.prediction_html.remove_class("so-tuner-pending")
            notes = setting_notes(self.values)
            self.notes_html.value = "".join(f"<div>&#9888; {html.escape(n)}</div>" for n in notes)
            self.controls["ratio"].disabled = self.values.get("weights") == "flow"
        self._show_status()

    # ----------------------------------------------------------------- widgets
    def render_prediction(self, pred: Prediction | None, line: str) -> str:
        """The prediction table as HTML (`controls.prediction_html`)."""
        return controls.prediction_html(self, pred, line)

    def apply_from_button(self) -> None:
        # a button callback has no cell to raise into: the status line carries the error
        with contextlib.suppress(ValueError, TypeError):
            self.apply()

    def _show_status(self) -> None:
        if self.widget is None:
            return
        blocked = self.apply_blocked()
        self.apply_button.disabled = blocked is not None
        self.apply_button.tooltip = blocked or "engine.reconfigure(...) with the changed settings"
        run = f"training {self.run_state.value} · " if self.run_state is not None else ""
        text = run + self.status_line
        # before the first Apply, why Apply is disabled says more than "not applied yet"
        untouched = self.status_line == "not applied yet"
        if blocked is not None and self.engine is not None and untouched:
            text = run + blocked
        self.status_html.value = html.escape(text)

    def _snapshot_lines(self) -> list[str]:
        return ["offload tuner (static snapshot)", describe_choice(self.shape, self.choice),
                _pairs(self.values), self.prediction_line, self.status_line]

    # ----------------------------------------------------------------- output
    def _ipython_display_(self) -> None:
        self.display()

    def display(self) -> None:
        """Show the controls in a notebook; print the settings and prediction elsewhere."""
        if self.widget is None or not _env.in_notebook():
            print(self.summary())
            reason = f"ipywidgets missing ({_env.INSTALL_HINT})"
            if self.widget is not None:
                reason = "not in a notebook"
            print(f"[superoffload] tuner controls need a notebook: {reason}; "
                  "tuner.set(ratio=...) works here")
            return
        out = snap.LiveOutput("tuner", self.widget, self._snapshot_lines,
                              css_class="so-tuner-snapshot")
        out.show()  # the only output of this display: frozen in place when the run ends
        self.live_outputs.append(out)

    def summary(self) -> str:
        return "\n".join(self._snapshot_lines()[1:4])

    def to_html(self, path: str | Path) -> Path:
        """A static page with the settings, the prediction and the simulated timeline."""
        from superoffload.widgets.tuner.page import write_page

        return write_page(self, Path(path))
