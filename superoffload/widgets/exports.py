"""What a dashboard writes for people to keep: a page, a CSV of every series, a saved run.

Functions over a recorder and a drawn figure (the dashboard's `to_html`, `to_csv`,
`csv_text` and `save_run` call them), so each export is one thing testable alone.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from superoffload.telemetry.recorder import Recorder
from superoffload.widgets import snapshot as snap

CSV_SCALARS = ("loss", "ratio")
"""The engine scalars a CSV carries beside the per-iteration metrics."""


def need_recorder(recorder: Recorder | None, what: str) -> Recorder:
    if recorder is None:
        raise ValueError(f"{what}: this dashboard follows no engine or recorder (a static or "
                         "simulated view has no recording to export)")
    return recorder


def csv_text(recorder: Recorder | None, title: str) -> str:
    """Every per-iteration series of the whole recorded run and its `CSV_SCALARS`, one row
    per iteration (`telemetry.csvfile.metrics_csv`)."""
    from superoffload.telemetry.csvfile import metrics_csv
    from superoffload.telemetry.runfile import run_from_recorder

    run = run_from_recorder(need_recorder(recorder, "csv_text"), title)
    return metrics_csv(run.metrics, {k: v for k, v in run.scalars.items() if k in CSV_SCALARS})


def write_text(path: str | Path, text: str) -> Path:
    """`text` to `path` (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def save_run(recorder: Recorder | None, folder: str | Path, *, name: str | None,
             title: str) -> Path:
    """`telemetry.runfile.save_run` of the dashboard's recorder."""
    from superoffload.telemetry.runfile import save_run as save

    return save(need_recorder(recorder, "save_run"), folder, name=name, meta={"title": title})


def page(fig: Any, lines: Sequence[str], title: str, *, include_plotlyjs: bool | str,
         config: dict[str, Any]) -> str:
    """A self-contained HTML page: the status lines above the figure (plotly.js embedded
    unless `include_plotlyjs` says otherwise)."""
    body = fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config=config)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title)}</title></head><body>"
            f"{snap.html_lines(lines)}{body}</body></html>")
