"""Jupyter views over telemetry and the planner: views only, no training logic.

    from superoffload.widgets import LiveDashboard, OffloadTuner, BackgroundTrainer

A folder per view: `dashboard/` (`LiveDashboard`: the engine's timeline, link GB/s while moving,
overlap, iteration time against the planner's prediction, loss and memory, live or of a finished
or simulated run, with smoothing, a wall-clock axis, panels to hide, runs to compare
(`BEFORE_AFTER`: this run around its last change), a Save button and CSV export; and the HTML
report), `tuner/` (`OffloadTuner`: the planner's prediction for every setting, applied to a
running engine) and `shared/` (the notebook plumbing both use: `BackgroundTrainer`, which runs
training off the cell so the widgets stay interactive, one run per engine; output slots frozen
into static snapshots; the live figure widget). `notebook_ci()` tells a notebook to take its
short CI path; `prepare_page()` starts loading the live figure's plotly.js in the page (the
first view of ours shown does it too). Every live view is replaced in place by a static snapshot
when its run ends, when the kernel shuts down (`freeze_all`) and, from the page, when it
restarts, so a saved notebook reopens without "model not found"; `placeholder(text)` holds a
view's place while it is being prepared. Everything degrades to text or static HTML outside a
notebook.
"""

from __future__ import annotations

import importlib
from typing import Any

from superoffload.widgets.shared.env import (
    WidgetsUnavailable,
    in_notebook,
    live_widgets_available,
    notebook_ci,
)

_LAZY = {
    "LiveDashboard": "superoffload.widgets.dashboard.dashboard",
    "OffloadTuner": "superoffload.widgets.tuner.tuner",
    "BackgroundTrainer": "superoffload.widgets.shared.trainer",
    "TrainResult": "superoffload.widgets.shared.trainer",
    "engine_step_fn": "superoffload.widgets.shared.trainer",
    "DashboardState": "superoffload.widgets.dashboard.state",
    "RunState": "superoffload.widgets.shared.runstate",
    "placeholder": "superoffload.widgets.shared.slots",
    "freeze_all": "superoffload.widgets.shared.slots",
    "BEFORE_AFTER": "superoffload.widgets.dashboard.compare",
    "write_html_report": "superoffload.widgets.dashboard.report",
    "prepare_page": "superoffload.widgets.shared.liveplot",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import superoffload.widgets` does not import plotly or numpy-heavy modules.
    if name not in _LAZY:
        raise AttributeError(f"module 'superoffload.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = ["WidgetsUnavailable", "in_notebook", "live_widgets_available", "notebook_ci", *_LAZY]
