"""Jupyter views over telemetry and the planner: views only, no training logic.

    from superoffload.widgets import LiveDashboard, OffloadTuner, BackgroundTrainer

`LiveDashboard` draws the engine's timeline, link GB/s while moving, overlap, iteration time
against the planner's prediction, loss and memory live (or a simulated result), on one
screen, with smoothing, a wall-clock axis, panels to hide, runs to compare (`BEFORE_AFTER`:
this run around its last change) and CSV export;
`OffloadTuner` shows the planner's prediction for every setting and applies settings to a
running engine; `BackgroundTrainer` runs training off the cell so the widgets stay
interactive. `notebook_ci()` tells a notebook to take its short CI path. Every live view is
replaced in place by a static snapshot when its run ends and when the kernel exits
(`freeze_all`), so a saved notebook reopens without "model not found"; `placeholder(text)`
holds a view's place while it is being prepared. Everything degrades to text or static HTML
outside a notebook.
"""

from __future__ import annotations

import importlib
from typing import Any

from superoffload.widgets._env import (
    WidgetsUnavailable,
    in_notebook,
    live_widgets_available,
    notebook_ci,
)

_LAZY = {
    "LiveDashboard": "superoffload.widgets.dashboard",
    "OffloadTuner": "superoffload.widgets.tuner",
    "BackgroundTrainer": "superoffload.widgets.background",
    "TrainResult": "superoffload.widgets.background",
    "engine_step_fn": "superoffload.widgets.background",
    "DashboardState": "superoffload.widgets.series",
    "RunState": "superoffload.widgets.runstate",
    "placeholder": "superoffload.widgets.snapshot",
    "freeze_all": "superoffload.widgets.snapshot",
    "BEFORE_AFTER": "superoffload.widgets.compare",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `import superoffload.widgets` does not import plotly or numpy-heavy modules.
    if name not in _LAZY:
        raise AttributeError(f"module 'superoffload.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = ["WidgetsUnavailable", "in_notebook", "live_widgets_available", "notebook_ci", *_LAZY]
