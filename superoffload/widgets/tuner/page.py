"""The tuner as a static page (``OffloadTuner.to_html``): its settings, prediction, comparison
and the simulated timeline, readable without a kernel."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared.plotjson import to_html
from superoffload.widgets.shared.profile import describe_choice
from superoffload.widgets.tuner.core import LABELS


def write_page(tuner: Any, path: Path) -> Path:
    """Write `tuner`'s page to `path` (an OffloadTuner); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"<tr><th>{html.escape(LABELS.get(k, k))}</th>"
                   f"<td>{html.escape(str(v))}</td></tr>" for k, v in tuner.values.items())
    described = html.escape(describe_choice(tuner.shape, tuner.choice))
    prediction = tuner.render_prediction(tuner.prediction, tuner.prediction_line)
    body = (f"<h2>offload tuner</h2><p>{described}</p>"
            f"<table>{rows}</table>{prediction}"
            f"<p>{html.escape(tuner.status_line)}</p>")
    if _env.plotly_available():
        from superoffload import plan
        from superoffload.widgets.dashboard.dashboard import LiveDashboard

        res = plan.simulate(tuner.shape, tuner.profile, system="superoffload", config=tuner.config)
        dash = LiveDashboard(None, live=False)
        dash.show_simulation(res, profile=tuner.profile)
        body += to_html(dash.figure, config={"responsive": True, "displaylogo": False},
                        include_plotlyjs=True)
    path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>offload tuner</title>"
                    f"</head><body>{body}</body></html>", encoding="utf-8")
    return path
