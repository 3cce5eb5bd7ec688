"""The dashboard's controls, one compact row above its figure: what TensorBoard and W&B users
reach for first.

    panels  [timeline] [time] [link] [overlap] [loss] [memory]   show or hide a panel
    smoothing  ----o----                                          EMA of every per-iteration line
    x [iteration ▾ | wall clock]                                  the per-iteration panels' x axis
    [compare with… ▾] [×]                                         overlay saved runs, or the
                                                                  iterations before/after a change
    [Save]                                                         keep this run under runs/
    [CSV]  download metrics.csv                                    every series, every iteration

Each control only calls the dashboard's public methods (`set_view`, `compare`, `save_run`,
`csv_text`), so what a click does is what a line of code does; a click reaches the kernel
as one small message (the figure itself only travels the other way: widgets/shared/liveplot.py).
The compare menu lists the runs under runs/ again whenever the dashboard saves one (at once)
and every few seconds (a run saved elsewhere).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from superoffload.telemetry.runfile import list_runs
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.compare import BEFORE_AFTER
from superoffload.widgets.dashboard.options import X_AXES

PICK = "compare with…"
"""The compare menu's resting entry."""
_SMALL = {"font_size": "11px"}


class Toolbar:
    """ipywidgets controls bound to a `LiveDashboard` (module docstring)."""

    def __init__(self, dash: Any, runs_dir: str | Path = "runs") -> None:
        import ipywidgets as w

        self.dash = dash
        self.runs_dir = Path(runs_dir)
        self._quiet = False
        self.panels: dict[str, Any] = {}
        for key, name in L.PANEL_NAMES.items():
            button = w.ToggleButton(value=key not in dash.view.hidden, description=name,
                                    tooltip=f"show or hide the {L.MEASURED[key].title} panel",
                                    layout=w.Layout(width="auto", height="24px", padding="0 5px"),
                                    style=_SMALL)
            button.add_class(f"so-dash-panel-{key}")
            button.observe(self._on_panels, names="value")
            self.panels[key] = button
        self.smoothing = w.FloatSlider(value=dash.view.smoothing, min=0.0, max=0.99, step=0.01,
                                       description="smooth", continuous_update=False,
                                       readout_format=".2f",
                                       tooltip="exponential moving average of every line "
                                               "(TensorBoard's smoothing)",
                                       style={"description_width": "48px"},
                                       layout=w.Layout(width="172px", height="26px"))
        self.smoothing.add_class("so-dash-smoothing")
        self.smoothing.observe(lambda ch: self._call(self.dash.set_view, smoothing=ch["new"]),
                               names="value")
        self.x_axis = w.Dropdown(options=list(X_AXES), value=dash.view.x_axis,
                                 description="x", style={"description_width": "12px"},
                                 layout=w.Layout(width="112px", height="26px"))
        self.x_axis.add_class("so-dash-xaxis")
        self.x_axis.observe(lambda ch: self._call(self.dash.set_view, x_axis=ch["new"]),
                            names="value")
        self.compare = w.Dropdown(options=self.compare_options(), value=PICK,
                                  layout=w.Layout(width="120px", height="26px"))
        self.compare.add_class("so-dash-compare")
        self.compare.observe(self._on_compare, names="value")
        self.clear = w.Button(description="", icon="times", tooltip="compare with nothing",
                              layout=w.Layout(width="30px", height="24px"), style=_SMALL)
        self.clear.add_class("so-dash-compare-clear")
        self.clear.on_click(lambda _b: self._call(self.dash.compare))
        self.save = w.Button(description="Save", icon="save",
                             tooltip=f"keep this run under {self.runs_dir}/ to compare with later "
                                     "(dash.save_run())",
                             layout=w.Layout(width="auto", height="24px"), style=_SMALL)
        self.save.add_class("so-dash-save")
        self.save.on_click(lambda _b: self.save_run())
        self.csv = w.Button(description="CSV", icon="download",
                            tooltip="every series of the run, one row per iteration",
                            layout=w.Layout(width="auto", height="24px"), style=_SMALL)
        self.csv.add_class("so-dash-csv")
        self.csv.on_click(lambda _b: self.make_csv_link())
        self.link = w.HTML(value="", layout=w.Layout(width="auto"))
        self.link.add_class("so-dash-csv-link")
        self.message = w.HTML(value="", layout=w.Layout(width="auto"))
        self.message.add_class("so-dash-toolbar-message")
        self.box = w.HBox([*self.panels.values(), self.smoothing, self.x_axis, self.compare,
                           self.clear, self.save, self.csv, self.link, self.message],
                          layout=w.Layout(width="auto", flex_flow="row wrap", align_items="center",
                                          grid_gap="2px 4px"))
        self.box.add_class("so-dash-toolbar")

    # ----------------------------------------------------------------- reading the view
    def compare_options(self) -> list[str]:
        """The compare menu: its resting entry, the before/after cut, the runs under runs/."""
        runs = [str(p) for p in list_runs(self.runs_dir)]
        return [PICK, BEFORE_AFTER, *runs]

    def sync(self) -> None:
        """Show the dashboard's view and comparison (after a change made in code)."""
        self._quiet = True
        try:
            for key, button in self.panels.items():
                button.value = key not in self.dash.view.hidden
            self.smoothing.value = self.dash.view.smoothing
            self.x_axis.value = self.dash.view.x_axis
            self._list_runs()
            # a menu of actions: it rests on its first entry
            self.compare.value = PICK
            labels = self.dash.comparison.labels()
            self.message.value = html.escape("comparing: " + ", ".join(labels)) if labels else ""
        finally:
            self._quiet = False

    def _list_runs(self) -> None:
        options = self.compare_options()
        if list(self.compare.options) != options:
            self.compare.options = options

    def refresh_runs(self) -> None:
        """List runs/ again (a run saved elsewhere since): the menu changes only if it did."""
        self._quiet = True
        try:
            self._list_runs()
        finally:
            self._quiet = False

    # ----------------------------------------------------------------- control events
    def _call(self, fn: Any, *args: Any, **kw: Any) -> None:
        if self._quiet:
            return
        try:
            fn(*args, **kw)
            self.message.value = ""
        except (ValueError, TypeError, OSError) as exc:
            # no cell to raise into: say it here
            self.message.value = f"<span style='color:#C00000'>{html.escape(str(exc))}</span>"
        self.sync()

    def _on_panels(self, _change: Any) -> None:
        hidden = [k for k, b in self.panels.items() if not b.value]
        self._call(self.dash.set_view, hidden=hidden)

    def _on_compare(self, change: Any) -> None:
        choice = change["new"]
        if self._quiet or choice == PICK:
            return
        current = list(self.dash.comparison.runs)
        self._call(self.dash.compare, *current, choice)

    def save_run(self) -> None:
        """Save this run under runs/ (`dash.save_run`); the compare menu lists it at once."""
        try:
            folder = self.dash.save_run()
        except (ValueError, TypeError, OSError) as exc:
            self.message.value = f"<span style='color:#C00000'>{html.escape(str(exc))}</span>"
            return
        self.message.value = html.escape(f"saved {folder}: in the compare menu")

    def make_csv_link(self) -> None:
        """Put a download link for the CSV of every series (`dash.csv_text`) in the bar."""
        text = self.dash.csv_text()
        data = base64.b64encode(text.encode("utf-8")).decode("ascii")
        rows = max(0, text.count("\n") - 1)
        self.link.value = (f"<a download='metrics.csv' href='data:text/csv;base64,{data}'>"
                           f"download metrics.csv ({rows:,} iterations)</a>")
