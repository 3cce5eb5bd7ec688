"""What a dashboard writes for people to keep: a page, a CSV of every series, a saved run.

Functions over a recorder and a drawn figure (the dashboard's `to_html`, `to_csv`,
`csv_text` and `save_run` call them), so each export is one thing testable alone.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.plotjson import to_html

CSV_SCALARS = ("loss", "ratio")
"""The engine scalars a CSV carries beside the per-iteration metrics."""


def need_recorder(recorder: Recorder | None, what: str) -> Recorder:
    if recorder is None:
        raise ValueError(f"{what}: this dashboard follows no engine or recorder (a static or "
                         "simulated view has no recording to export)")
    return recorder


def csv_text(recorder: Recorder | None, title: str) -> str:
    """Every per-iteration series of the whole recorded run and its `CSV_SCALARS`, one row
    per iteration; the iterations whose spans left the recorder's buffer, one row per bin of
    its archive (`telemetry.csvfile.metrics_csv`)."""
    from superoffload.telemetry.csvfile import metrics_csv
    from superoffload.telemetry.runfile import run_from_spans

    rec = need_recorder(recorder, "csv_text")
    archive, spans = rec.whole_run()
    scalars: dict[str, list[tuple[int, float]]] = {
        name: [] for name in CSV_SCALARS if name in archive.scalars}
    for sc in rec.scalars():
        if sc.name in CSV_SCALARS:
            scalars.setdefault(sc.name, []).append((sc.iteration, sc.value))
    run = run_from_spans(spans, title, scalars=scalars)
    return metrics_csv(run.metrics, run.scalars, archive=archive)


def write_text(path: str | Path, text: str) -> Path:
    """`text` to `path` (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def new_run_folder(runs_dir: Path, title: str) -> Path:
    """A folder under `runs_dir` for a run saved now: the title and the time, made unique
    ("runs/superoffload-20261204-153012")."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", title).strip("-") or "run"
    base = runs_dir / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, k = base, 1
    while out.exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return out


def save_run(recorder: Recorder | None, folder: str | Path, *, name: str | None,
             title: str) -> Path:
    """`telemetry.runfile.save_run` of the dashboard's recorder."""
    from superoffload.telemetry.runfile import save_run as save

    return save(need_recorder(recorder, "save_run"), folder, name=name, meta={"title": title})


def page(fig: dict[str, Any], lines: Sequence[str], title: str, *,
         include_plotlyjs: bool | str, config: dict[str, Any]) -> str:
    """A self-contained HTML page: the status lines above the figure (a figure dict; plotly.js
    embedded unless `include_plotlyjs` says otherwise)."""
    body = to_html(fig, config=config, include_plotlyjs=include_plotlyjs)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title)}</title></head><body>"
            f"{snap.html_lines(lines)}{body}</body></html>")
