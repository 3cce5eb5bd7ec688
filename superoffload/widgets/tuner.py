"""`OffloadTuner`: controls for every offload setting with the planner's prediction, live.

    tuner = OffloadTuner(plan.ModelShape(...), "gh200")               # what-if, no engine
    tuner = OffloadTuner(model, engine=engine, seq=64, micro_batch=8)  # this machine, live
    tuner                                                              # shows the controls

Every control change re-runs `plan.simulate` off the kernel's main thread, once the
controls have been still for `debounce_s` (a held arrow key sends dozens of values; only
the last is predicted), and rewrites the prediction table. The profile is this machine's
measured one unless another is given, and the title says which. With an engine attached,
"Apply to engine" sends the changed fields to `engine.reconfigure(...)` (in force from the
next iteration); it is disabled when nothing can take the change (no engine, an engine
that cannot reconfigure, nothing changed). A small static snapshot under the controls
keeps the last settings and prediction readable in a saved notebook.
"""

from __future__ import annotations

import contextlib
import html
import itertools
from pathlib import Path
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.runtime import step_listener
from superoffload.widgets import _env
from superoffload.widgets import snapshot as snap
from superoffload.widgets import tuner_compare as compare
from superoffload.widgets import tuner_live as live
from superoffload.widgets.debounce import Executor, Inline, LatestOnly
from superoffload.widgets.predict import ProfileChoice, describe, resolve_profile, to_shape
from superoffload.widgets.runstate import RunState
from superoffload.widgets.tuner_core import (
    CHOICES,
    LABELS,
    TUNED_FIELDS,
    Prediction,
    apply_block_reason,
    baseline_iteration_s,
    bucket_options,
    engine_changes,
    format_bytes,
    predict,
    prediction_rows,
    prediction_text,
    reconfigurable_fields,
    setting_notes,
)


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
        self.values: dict[str, Any] = {name: getattr(self.base_config, name) for name in TUNED_FIELDS}
        self._derived_threads = self.values["cpu_threads"] is None
        if self._derived_threads:  # the slider needs a number: what cpu_cores_frac gives here
            self.values["cpu_threads"] = self._default_threads()
        self._shown_default_threads = self.values["cpu_threads"]
        self.baseline_s = baseline_iteration_s(self.shape, self.profile) if compare_baseline else None
        self.prediction: Prediction | None = None
        self.prediction_line = ""
        self.run_state: RunState | None = None
        self.status_line = "no engine attached (what-if mode)" if engine is None else "not applied yet"
        self.applied: list[dict[str, Any]] = []
        self.measure_apply = measure_apply
        """Apply measures the change as an interleaved A/B (runtime/ab_trial.py) when the
        engine takes step hooks; False: reconfigure at once, unmeasured."""
        self.ab_block, self.ab_pairs = ab_block, ab_pairs
        self.trial: Any = None
        """The A/B of the last Apply (``ABTrial``), while and after it runs."""
        self.ab_results: list[Any] = []
        """Every finished A/B (``telemetry.abtest.ABResult``), oldest first."""
        self.changes: list[Any] = []
        """``tuner_compare.ChangeRow`` per control that differs from the settings in force."""
        self.curve: list[tuple[float, float | None]] = []
        """Predicted seconds over the ratio (``tuner_compare.ratio_curve``)."""
        self._sent: dict[str, Any] = {}
        self.controls: dict[str, Any] = {}
        self._seq = itertools.count()
        self._latest = 0
        self._quiet = False
        self._snapshot = snap.Slot("tuner-snapshot")
        self.live_outputs: list[snap.LiveOutput] = []
        """Where the controls are shown; each is frozen in place into the snapshot when the
        run ends or the kernel exits (a reopened notebook shows it, not "model not found")."""
        self.widget: Any = self._build_widgets() if _env.has_module("ipywidgets") else None
        self.executor: Executor = LatestOnly(debounce_s) if self.widget is not None and debounce_s > 0 else Inline()
        self._show(*self._predict(self.config))
        self.calibrator: Any = live.start_calibrator(self, calibrate_after, profile is None)
        """The AutoCalibrator on the attached engine (None: none); when it has run the tuner
        predicts with its profile (widgets/tuner_live.py)."""

    def use_calibration(self, report: Any) -> None:
        """The engine ran long enough: predict with the profile fitted to it."""
        self.choice = ProfileChoice(report.profile, f"calibrated on this run: {report.line()}")
        self.profile = report.profile
        self._show(*self._predict(self.config))

    # ----------------------------------------------------------------- state
    @property
    def config(self) -> OffloadConfig:
        """The OffloadConfig the controls describe now."""
        values = dict(self.values)
        if self._derived_threads and values["cpu_threads"] == self._shown_default_threads:
            values["cpu_threads"] = None  # untouched: keep deriving it from cpu_cores_frac
        return self.base_config.replace(**values)

    def set(self, **values: Any) -> Prediction:
        """Set controls by field name (as a user would); returns the new prediction (computed
        in this thread, so the caller reads it at once)."""
        unknown = sorted(set(values) - set(TUNED_FIELDS))
        if unknown:
            raise ValueError(f"OffloadTuner.set: unknown control(s) {unknown}; known: {list(TUNED_FIELDS)}")
        self.base_config.replace(**{**self.values, **values})  # validate before touching anything
        self._quiet = True
        try:
            for name, value in values.items():
                self.values[name] = value
                control = self.controls.get(name)
                if control is None:
                    continue
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
        self._sent = {k: v for k, v in self._sent.items() if getattr(current, k) != v}
        target = current.replace(**self._sent) if self._sent else current
        return engine_changes(target, self.config, reconfigurable_fields(self.engine))

    def apply_blocked(self) -> str | None:
        """Why Apply is disabled now (None: enabled)."""
        reason = apply_block_reason(self.engine, reconfigurable_fields(self.engine) if self.engine
                                    is not None else frozenset(), bool(getattr(self.engine, "closed", False)))
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
            raise ValueError("OffloadTuner.apply: no engine attached; pass engine=... to OffloadTuner")
        changes, restart = self._live_changes()
        iteration = getattr(self.engine, "iteration", "?")
        later = "; needs a restart: " + ", ".join(f"{k}={v}" for k, v in restart.items()) if restart else ""
        measure = self.measure_apply if measure is None else measure
        if not changes:
            self.status_line = f"nothing to apply at iteration {iteration}{later}"
        else:
            try:
                if measure and step_listener.supported(self.engine):
                    self.trial = live.start_trial(self, changes)
                else:
                    self.engine.reconfigure(**changes)
            except (ValueError, TypeError) as exc:
                self.status_line = f"engine refused {changes}: {exc}"
                self._show_status()
                raise
            self.applied.append(dict(changes))
            self._sent.update(changes)
            shown = ", ".join(f"{k}={v}" for k, v in changes.items())
            when = ("training is not running: it takes effect at the next iteration trained"
                    if self.run_state is not None and self.run_state is not RunState.RUNNING
                    else "in force from the next iteration")
            self.status_line = f"applied {shown} at iteration {iteration} ({when}){later}"
            if self.trial is not None and not self.trial.done and self.trial.new == changes:
                self.status_line += (f"; measuring it as an A/B: old and new settings "
                                     f"alternate, {self.ab_pairs} pairs of {self.ab_block} "
                                     "iterations, then the new ones stay")
        self._show_status()
        return changes

    def record_trial(self, trial: Any) -> None:
        """In the training thread, when an A/B ends with a result."""
        self.ab_results.append(trial.result)
        self.status_line = f"measured: {trial.result.line()}"
        self._show_status()

    def close(self) -> None:
        """Stop the prediction worker thread."""
        self.executor.close()

    # ----------------------------------------------------------------- predicting
    def _predict(self, config: OffloadConfig | None) -> tuple[Prediction | None, str, Any, Any]:
        """The planner's answer for `config` (any thread): prediction, its line, a simulation
        and (change rows, ratio curve), which only `_show` stores."""
        if config is None:
            return None, self.prediction_line, None, None
        pred = predict(self.shape, self.profile, config, baseline_s=self.baseline_s)
        in_force = self.engine.config if self.engine is not None else self.base_config
        compared = (compare.change_rows(self.shape, self.profile, in_force, config, TUNED_FIELDS),
                    compare.ratio_curve(self.shape, self.profile, config))
        sim = None
        if self.preview is not None:
            from superoffload import plan

            sim = plan.simulate(self.shape, self.profile, schedule="superoffload", config=config)
        return pred, prediction_text(pred), sim, compared

    def _on_control(self, change: dict[str, Any]) -> None:
        owner = change["owner"]
        name = next(n for n, c in self.controls.items() if c is owner)
        self.values[name] = change["new"]
        if self._quiet:
            return
        try:
            config = self.config
        except ValueError as exc:
            self.prediction_line = f"invalid setting: {exc}"
            self._show(None, self.prediction_line, None)
            return
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
            self.prediction_line = f"the planner failed on this setting: {exc}"
            self._show(None, self.prediction_line, None)
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
    def _default_threads(self) -> int:
        import os

        cores = int(getattr(self.profile, "cpu_cores", os.cpu_count() or 1))
        return max(1, round(cores * self.base_config.cpu_cores_frac))

    def _build_widgets(self) -> Any:
        import ipywidgets as w

        c = self.controls
        full = w.Layout(width="100%", margin="2px 0px")  # no side margins: 100 % fits its cell
        c["ratio"] = w.FloatSlider(value=float(self.values["ratio"]), min=0.0, max=1.0, step=0.05,
                                   readout_format=".2f", continuous_update=True, layout=full)
        c["bucket_bytes"] = w.SelectionSlider(options=bucket_options(self.values["bucket_bytes"]),
                                              value=self.values["bucket_bytes"], layout=full)
        for name, options in CHOICES.items():
            c[name] = w.ToggleButtons(options=list(options), value=self.values[name],
                                      style={"button_width": "86px"})
        max_threads = max(int(getattr(self.profile, "cpu_cores", 1)), int(self.values["cpu_threads"]))
        c["cpu_threads"] = w.IntSlider(value=int(self.values["cpu_threads"]), min=1, max=max_threads,
                                       layout=full)
        rows = []
        for name in TUNED_FIELDS:
            control = c.get(name)
            if control is None:
                continue
            control.observe(self._on_control, names="value")
            control.add_class(f"so-tuner-{name.replace('_', '-')}")
            label = w.HTML(value=f"<span title='OffloadConfig.{name}'>{html.escape(LABELS.get(name, name))}</span>")
            rows += [label, control]
        grid = w.GridBox(rows, layout=w.Layout(grid_template_columns="minmax(150px, 230px) minmax(0, 1fr)",
                                               grid_gap="4px 12px", width="auto", align_items="center"))
        self.notes_html = w.HTML(value="")
        self.notes_html.add_class("so-tuner-notes")
        self.prediction_html = w.HTML(value="", layout=w.Layout(width="auto"))
        self.prediction_html.add_class("so-tuner-prediction")
        self.apply_button = w.Button(description="Apply to engine", button_style="primary",
                                     disabled=True, layout=w.Layout(width="auto", min_width="150px"))
        self.apply_button.add_class("so-tuner-apply")
        self.apply_button.on_click(lambda _button: self._apply_from_button())
        self.status_html = w.HTML(value="", layout=w.Layout(width="auto", flex="1 1 0%"))
        self.status_html.add_class("so-tuner-status")
        title = w.HTML(value=f"<b>offload tuner</b> · {html.escape(describe(self.shape, self.choice))}")
        box = w.VBox([title, grid, self.notes_html, self.prediction_html,
                      w.HBox([self.apply_button, self.status_html], layout=w.Layout(width="auto"))],
                     layout=w.Layout(width="auto", max_width="980px"))  # auto: 100 % + margins overflowed
        box.add_class("so-tuner")
        return box

    def render_prediction(self, pred: Prediction | None, line: str) -> str:
        # name the settings the table is for: a slider moves faster than the kernel answers
        shown = (f"ratio {float(self.values['ratio']):.2f}, "
                 f"{format_bytes(self.values['bucket_bytes'])} buckets")
        head = f"<div><b>predicted</b> for {html.escape(shown)} on {html.escape(self.choice.name)}</div>"
        if pred is None:
            return head + f"<div style='color:#C00000'>{html.escape(line)}</div>"
        cells = []
        for label, value, ok in prediction_rows(pred):
            style = " style='color:#C00000;font-weight:bold'" if ok is False else ""
            cells.append(f"<tr><th style='text-align:left;padding-right:12px'>{html.escape(label)}</th>"
                         f"<td{style}>{html.escape(value)}</td></tr>")
        curve = (f"<div class='so-tuner-curve-box'>{compare.curve_svg(self.curve, float(self.values['ratio']))}"
                 f"<div>{html.escape(compare.curve_summary(self.curve))}</div></div>") if self.curve else ""
        return (head + f"<table style='border-collapse:collapse'>{''.join(cells)}</table>"
                + compare.change_table_html(self.changes) + curve)

    def _apply_from_button(self) -> None:
        # A button callback has no cell to raise into: the status line carries the error.
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
        if blocked is not None and self.engine is not None and not self.status_line.startswith("applied"):
            text = run + blocked
        self.status_html.value = html.escape(text)
        self._snapshot.update(snap.text_bundle(self._snapshot_lines()))

    def _snapshot_lines(self) -> list[str]:
        settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return ["offload tuner (static snapshot)", describe(self.shape, self.choice), settings,
                self.prediction_line, self.status_line]

    # ----------------------------------------------------------------- output
    def _ipython_display_(self) -> None:
        self.display()

    def display(self) -> None:
        """Show the controls in a notebook; print the settings and prediction elsewhere."""
        if self.widget is None or not _env.in_notebook():
            print(self.summary())
            reason = "not in a notebook" if self.widget is not None else f"ipywidgets missing ({_env.INSTALL_HINT})"
            print(f"[superoffload] tuner controls need a notebook: {reason}; tuner.set(ratio=...) works here")
            return
        out = snap.LiveOutput("tuner", self.widget, self._snapshot_lines, css_class="so-tuner-snapshot")
        out.show()
        self.live_outputs.append(out)
        self._snapshot.show(snap.text_bundle(self._snapshot_lines()))

    def summary(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"{describe(self.shape, self.choice)}\n{settings}\n{self.prediction_line}"

    def to_html(self, path: str | Path) -> Path:
        """A static page with the settings, the prediction and the simulated timeline."""
        from superoffload.widgets.tuner_page import write_page

        return write_page(self, Path(path))
