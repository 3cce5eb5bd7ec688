"""`OffloadTuner`: controls for every offload setting with the planner's prediction, live.

    tuner = OffloadTuner(plan.ModelShape(...), "gh200")          # what-if, no engine
    tuner = OffloadTuner(model, "cpu-laptop", engine=engine, seq=64)  # attached to training
    tuner                                                         # shows the controls

Every control change re-runs `plan.simulate` (milliseconds) and rewrites the prediction
line; with an engine attached, "apply" sends the changed fields to
`engine.reconfigure(...)`, which takes effect at the next iteration boundary: the
dashboard's title and traces show it on the following steps. This only works while
training runs in a background thread (see `BackgroundTrainer`): a cell that is still
running never receives the button press.
"""

from __future__ import annotations

import contextlib
import html
import os
from pathlib import Path
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.widgets import _env
from superoffload.widgets.tuner_core import (
    TUNED_FIELDS,
    Prediction,
    baseline_iteration_s,
    bucket_options,
    engine_changes,
    format_bytes,
    predict,
    prediction_text,
    reconfigurable_fields,
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "grad_cast": ("device", "host", "auto"),
    "param_cast": ("device", "host", "auto"),
    "weights": ("stationary", "flow", "auto"),
    "speculation": ("on", "off", "adaptive"),
}
_LABELS = {
    "ratio": "ratio (CPU share)",
    "bucket_bytes": "bucket size",
    "grad_cast": "grad cast on",
    "param_cast": "param cast on",
    "weights": "weights",
    "speculation": "STV",
    "cpu_threads": "CPU threads",
}


class OffloadTuner:
    """Sliders and toggles over the tuned OffloadConfig fields, a prediction, an apply button."""

    def __init__(
        self,
        shape_or_model: Any,
        profile: Any = "gh200",
        engine: Any = None,
        *,
        config: OffloadConfig | None = None,
        seq: int | None = None,
        micro_batch: int = 1,
        preview: Any = None,
        compare_baseline: bool = True,
    ) -> None:
        from superoffload import plan

        self.shape = _to_shape(shape_or_model, seq=seq, micro_batch=micro_batch)
        self.profile = plan.profiles.get(profile) if isinstance(profile, str) else profile
        self.engine = engine
        base = config or (engine.config if engine is not None else OffloadConfig())
        if not isinstance(base, OffloadConfig):
            raise TypeError(f"config={base!r} must be a superoffload.OffloadConfig")
        self.base_config = base.replace()  # a validated copy the controls start from
        self.preview = preview
        self.values: dict[str, Any] = {name: getattr(self.base_config, name) for name in TUNED_FIELDS}
        self._derived_threads = self.values["cpu_threads"] is None
        if self._derived_threads:
            # the slider needs a number: show what cpu_cores_frac derives on this profile
            self.values["cpu_threads"] = self._default_threads()
        self._shown_default_threads = self.values["cpu_threads"]
        self.baseline_s = baseline_iteration_s(self.shape, self.profile) if compare_baseline else None
        self.prediction: Prediction | None = None
        self.prediction_line = ""
        self.status_line = "no engine attached (what-if mode)" if engine is None else "not applied yet"
        self.applied: list[dict[str, Any]] = []
        self.controls: dict[str, Any] = {}
        self.widget: Any = self._build_widgets() if _env.has_module("ipywidgets") else None
        self._update()

    # ----------------------------------------------------------------- state
    @property
    def config(self) -> OffloadConfig:
        """The OffloadConfig the controls describe now."""
        values = dict(self.values)
        if self._derived_threads and values["cpu_threads"] == self._shown_default_threads:
            values["cpu_threads"] = None  # untouched: keep deriving it from cpu_cores_frac
        return self.base_config.replace(**values)

    def set(self, **values: Any) -> Prediction:
        """Set controls by field name (as a user would); returns the new prediction."""
        unknown = sorted(set(values) - set(TUNED_FIELDS))
        if unknown:
            raise ValueError(f"OffloadTuner.set: unknown control(s) {unknown}; known: {list(TUNED_FIELDS)}")
        self.base_config.replace(**{**self.values, **values})  # validate before touching anything
        for name, value in values.items():
            control = self.controls.get(name)
            if control is None:
                self.values[name] = value
                continue
            if name == "bucket_bytes" and value not in dict(control.options).values():
                merged = set(bucket_options(value)) | {tuple(o) for o in control.options}
                control.options = sorted(merged, key=lambda o: o[1])
            control.value = value  # fires the observer: values and prediction follow
        if not self.controls:
            self._update()
        assert self.prediction is not None
        return self.prediction

    def apply(self) -> dict[str, Any]:
        """Send the changed settings to the attached engine (applied between iterations)."""
        if self.engine is None:
            raise ValueError("OffloadTuner.apply: no engine attached; pass engine=... to OffloadTuner")
        changes, restart = engine_changes(
            self.engine.config, self.config, reconfigurable_fields(self.engine)
        )
        iteration = getattr(self.engine, "iteration", "?")
        later = (
            "; needs a restart: " + ", ".join(f"{k}={v}" for k, v in restart.items()) if restart else ""
        )
        if not changes:
            self.status_line = f"nothing to apply at iteration {iteration}{later}"
        else:
            try:
                self.engine.reconfigure(**changes)
            except (ValueError, TypeError) as exc:
                self.status_line = f"engine refused {changes}: {exc}"
                self._show_status()
                raise
            self.applied.append(dict(changes))
            shown = ", ".join(f"{k}={v}" for k, v in changes.items())
            self.status_line = (
                f"applied {shown} at iteration {iteration} (in force from the next one){later}"
            )
        self._show_status()
        return changes

    # ----------------------------------------------------------------- widgets
    def _default_threads(self) -> int:
        cores = int(getattr(self.profile, "cpu_cores", os.cpu_count() or 1))
        return max(1, round(cores * self.base_config.cpu_cores_frac))

    def _build_widgets(self) -> Any:
        import ipywidgets as w

        style = {"description_width": "110px"}
        layout = w.Layout(width="460px")
        c = self.controls
        c["ratio"] = w.FloatSlider(
            value=float(self.values["ratio"]), min=0.0, max=1.0, step=0.05, readout_format=".2f",
            description=_LABELS["ratio"], style=style, layout=layout, continuous_update=True,
        )
        c["bucket_bytes"] = w.SelectionSlider(
            options=bucket_options(self.values["bucket_bytes"]), value=self.values["bucket_bytes"],
            description=_LABELS["bucket_bytes"], style=style, layout=layout,
        )
        for name, options in _CHOICES.items():
            c[name] = w.ToggleButtons(
                options=list(options), value=self.values[name], description=_LABELS[name], style=style,
            )
        max_threads = max(int(getattr(self.profile, "cpu_cores", 1)), int(self.values["cpu_threads"]))
        c["cpu_threads"] = w.IntSlider(
            value=int(self.values["cpu_threads"]), min=1, max=max_threads,
            description=_LABELS["cpu_threads"], style=style, layout=layout,
        )
        for name, control in c.items():
            control.observe(self._on_control, names="value")
            control.add_class(f"so-tuner-{name.replace('_', '-')}")
        self.prediction_html = w.HTML(value="")
        self.prediction_html.add_class("so-tuner-prediction")
        self.apply_button = w.Button(
            description="Apply to engine", button_style="primary", disabled=self.engine is None,
            tooltip="engine.reconfigure(...) with the changed settings; in force next iteration",
        )
        self.apply_button.add_class("so-tuner-apply")
        self.apply_button.on_click(lambda _button: self._apply_from_button())
        self.status_html = w.HTML(value="")
        self.status_html.add_class("so-tuner-status")
        title = w.HTML(value=f"<b>offload tuner</b> · {html.escape(_describe(self.shape, self.profile))}")
        return w.VBox([title, *c.values(), self.prediction_html, w.HBox([self.apply_button, self.status_html])])

    def _on_control(self, change: dict[str, Any]) -> None:
        owner = change["owner"]
        name = next(n for n, c in self.controls.items() if c is owner)
        self.values[name] = change["new"]
        self._update()

    def _apply_from_button(self) -> None:
        # A button callback has no cell to raise into: the status line carries the error.
        with contextlib.suppress(ValueError, TypeError):
            self.apply()

    def _update(self) -> None:
        try:
            config = self.config
        except ValueError as exc:
            self.prediction_line = f"invalid setting: {exc}"
        else:
            self.prediction = predict(self.shape, self.profile, config, baseline_s=self.baseline_s)
            self.prediction_line = prediction_text(self.prediction)
            if self.preview is not None:
                from superoffload import plan

                self.preview.show_simulation(
                    plan.simulate(self.shape, self.profile, schedule="superoffload", config=config)
                )
        if self.widget is not None:
            # name the settings the line is for: a slider moves faster than the kernel answers
            shown = f"ratio {float(self.values['ratio']):.2f}, {format_bytes(self.values['bucket_bytes'])} buckets"
            self.prediction_html.value = (
                f"<code>{html.escape(shown)} → {html.escape(self.prediction_line)}</code>"
            )
        self._show_status()

    def _show_status(self) -> None:
        if self.widget is not None:
            self.status_html.value = html.escape(self.status_line)

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
        from IPython.display import display

        display(self.widget)

    def summary(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"{_describe(self.shape, self.profile)}\n{settings}\n{self.prediction_line}"

    def to_html(self, path: str | Path) -> Path:
        """A static page with the settings, the prediction and the simulated timeline."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = "".join(
            f"<tr><th>{html.escape(_LABELS[k])}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in self.values.items()
        )
        body = (
            f"<h2>offload tuner</h2><p>{html.escape(_describe(self.shape, self.profile))}</p>"
            f"<table>{rows}</table><p><code>{html.escape(self.prediction_line)}</code></p>"
            f"<p>{html.escape(self.status_line)}</p>"
        )
        if _env.plotly_available():
            from superoffload import plan
            from superoffload.widgets.dashboard import LiveDashboard

            res = plan.simulate(self.shape, self.profile, schedule="superoffload", config=self.config)
            dash = LiveDashboard(None, live=False)
            dash.show_simulation(res)
            body += dash.figure.to_html(full_html=False, include_plotlyjs=True)
        path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>offload tuner</title>"
                        f"</head><body>{body}</body></html>")
        return path


def _to_shape(shape_or_model: Any, *, seq: int | None, micro_batch: int) -> Any:
    from superoffload.plan.shapes import ModelShape

    if isinstance(shape_or_model, ModelShape):
        return shape_or_model
    if hasattr(shape_or_model, "parameters"):
        if seq is None:
            cfg = getattr(shape_or_model, "cfg", None) or getattr(shape_or_model, "config", None)
            seq = getattr(cfg, "seq_len", None) or getattr(cfg, "block_size", None)
        if not isinstance(seq, int):
            raise ValueError("OffloadTuner(model, ...): pass seq=<tokens per sequence> for an nn.Module")
        return ModelShape.from_module(shape_or_model, seq=seq, micro_batch=micro_batch)
    raise TypeError(
        f"OffloadTuner(shape_or_model={type(shape_or_model).__name__}): pass a plan.ModelShape or an nn.Module"
    )


def _describe(shape: Any, profile: Any) -> str:
    params = getattr(shape, "params", None)
    size = f"{params / 1e9:.2f}B params" if isinstance(params, int) and params >= 1e8 else (
        f"{params / 1e6:.2f}M params" if isinstance(params, int) else "model")
    return f"{size}, seq {shape.seq} x batch {shape.micro_batch} on {getattr(profile, 'name', profile)}"
