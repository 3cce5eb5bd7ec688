"""The tuner's widgets and its prediction table as HTML: the view half of `OffloadTuner`
(tuner.py), built from its public state."""

from __future__ import annotations

import html
from typing import Any

from superoffload.widgets.shared.profile import describe_choice
from superoffload.widgets.tuner.changes import change_table_html, curve_summary, curve_svg
from superoffload.widgets.tuner.core import (
    CONTROL_FIELDS,
    DROPDOWNS,
    LABELS,
    Prediction,
    bucket_options,
    format_bytes,
    prediction_rows,
)


def build_controls(tuner: Any) -> Any:
    """The tuner's box: a labelled control per tuned field, notes, the prediction table, the
    Apply and Measure-longer buttons with the status line (`OffloadTuner` keeps the pieces)."""
    import ipywidgets as w

    c = tuner.controls
    # no side margins: 100 % fits its cell
    full = w.Layout(width="100%", margin="2px 0px")
    c["ratio"] = w.FloatSlider(value=float(tuner.values["ratio"]), min=0.0, max=1.0, step=0.05,
                               readout_format=".2f", continuous_update=True, layout=full)
    c["bucket_bytes"] = w.SelectionSlider(options=bucket_options(tuner.values["bucket_bytes"]),
                                          value=tuner.values["bucket_bytes"], layout=full)
    for name, options in DROPDOWNS.items():
        c[name] = w.ToggleButtons(options=list(options), value=tuner.values[name],
                                  style={"button_width": "86px"})
    max_threads = max(int(getattr(tuner.profile, "cpu_cores", 1)), int(tuner.values["cpu_threads"]))
    c["cpu_threads"] = w.IntSlider(value=int(tuner.values["cpu_threads"]), min=1, max=max_threads,
                                   layout=full)
    rows = []
    for name in CONTROL_FIELDS:
        control = c.get(name)
        if control is None:
            continue
        control.observe(tuner.on_control, names="value")
        control.add_class(f"so-tuner-{name.replace('_', '-')}")
        text = html.escape(LABELS.get(name, name))
        label = w.HTML(value=f"<span title='OffloadConfig.{name}'>{text}</span>")
        rows += [label, control]
    # minmax(0, 1fr): the controls' column may shrink below its content's width, so the
    # grid never grows wider than a narrow output area
    columns = "minmax(150px, 230px) minmax(0, 1fr)"
    grid = w.GridBox(rows, layout=w.Layout(grid_template_columns=columns, grid_gap="4px 12px",
                                           width="auto", align_items="center"))
    tuner.notes_html = w.HTML(value="")
    tuner.notes_html.add_class("so-tuner-notes")
    tuner.prediction_html = w.HTML(value="", layout=w.Layout(width="auto"))
    tuner.prediction_html.add_class("so-tuner-prediction")
    tuner.apply_button = w.Button(description="Apply to engine", button_style="primary",
                                 disabled=True, layout=w.Layout(width="auto", min_width="150px"))
    tuner.apply_button.add_class("so-tuner-apply")
    tuner.apply_button.on_click(lambda _button: tuner.apply_from_button())
    tuner.measure_button = w.Button(description="Measure longer", disabled=True, icon="clock-o",
                                    tooltip="run more A/B pairs of the last change",
                                    layout=w.Layout(width="auto", min_width="130px"))
    tuner.measure_button.add_class("so-tuner-measure-longer")
    tuner.measure_button.on_click(lambda _button: tuner.measure_longer_from_button())
    tuner.status_html = w.HTML(value="", layout=w.Layout(width="auto", flex="1 1 0%"))
    tuner.status_html.add_class("so-tuner-status")
    described = html.escape(describe_choice(tuner.shape, tuner.choice))
    title = w.HTML(value=f"<b>offload tuner</b> · {described}")
    buttons = w.HBox([tuner.apply_button, tuner.measure_button, tuner.status_html],
                     layout=w.Layout(width="auto"))
    # width auto: "100%" plus the output area's margins overflowed it
    box = w.VBox([title, grid, tuner.notes_html, tuner.prediction_html, buttons],
                 layout=w.Layout(width="auto", max_width="980px"))
    box.add_class("so-tuner")
    return box


def prediction_html(tuner: Any, pred: Prediction | None, line: str) -> str:
    """The prediction table, the predicted change of each moved control and the ratio curve;
    it names the settings it is for (a slider moves faster than the kernel answers)."""
    shown = (f"ratio {float(tuner.values['ratio']):.2f}, "
             f"{format_bytes(tuner.values['bucket_bytes'])} buckets")
    head = (f"<div><b>predicted</b> for {html.escape(shown)} on "
            f"{html.escape(tuner.choice.name)}</div>")
    if pred is None:
        return head + f"<div style='color:#C00000'>{html.escape(line)}</div>"
    cells = []
    for label, value, ok in prediction_rows(pred):
        style = " style='color:#C00000;font-weight:bold'" if ok is False else ""
        head_style = "text-align:left;padding-right:12px;white-space:nowrap;vertical-align:top"
        cells.append(f"<tr><th style='{head_style}'>{html.escape(label)}</th>"
                     f"<td{style}>{html.escape(value)}</td></tr>")
    curve = ""
    if tuner.curve:
        svg = curve_svg(tuner.curve, float(tuner.values["ratio"]))
        curve = (f"<div class='so-tuner-curve-box'>{svg}"
                 f"<div>{html.escape(curve_summary(tuner.curve))}</div></div>")
    return (head + f"<table style='border-collapse:collapse'>{''.join(cells)}</table>"
            + change_table_html(tuner.changes) + curve)

