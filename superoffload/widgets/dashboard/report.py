"""The HTML report a user keeps: one self-contained file that reads like the dashboard.

    write_html_report(engine.telemetry, "runs/latest/report.html", title="GPT small, CPU")

What it holds, top to bottom, full width:
  1. the summary: the run's pooled figures in the metric vocabulary (`telemetry.vocabulary`: the
     same words, units and definitions as the dashboard, the CLI and the logs), the loss,
     the engine's notes;
  2. the dashboard's own figure of the whole run (`figure.build_figure` + `write_state` on a
     state fed every recorded span and scalar, and the recorder's archive of a run longer than
     its buffer: the same panels, palette, titles and axis units as the live view;
     per-iteration lines binned with their min..max when long, from the run's first
     iteration);
  3. the link's traffic over time (per direction, in the dashboard's colours: D2H red, H2D
     blue) and one chart per other recorded series (learning rate, grad norm, ...), each
     titled with its vocabulary label and unit;
  4. the settings and the full pooled figures as tables, last.

plotly.js is embedded once in the file (~4.8 MB), so the page opens offline, alone, without a
`plotly.min.js` beside it; `inline_js=False` writes it beside the page instead (several
reports in one folder share it). Without plotly the report is tables only and says how to
get the charts.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.archive import IterationArchive
from superoffload.telemetry.events import Span
from superoffload.telemetry.metrics import (
    IterationMetrics,
    Summary,
    bandwidth_series,
    iteration_metrics,
    summarize_metrics,
)
from superoffload.telemetry.ranks import by_rank, lane_label, summarize_by_rank
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.figure import FONT, PLOT_CONFIG, build_figure, write_state
from superoffload.widgets.dashboard.state import SCALARS
from superoffload.widgets.dashboard.whole_run import PAGE_POINTS, state_from
from superoffload.widgets.shared.plotjson import to_html

ScalarSeries = Sequence[tuple[int, float]]
PLOTLY_JS = "plotly.min.js"
_STYLE_LAYOUT: dict[str, Any] = {
    "autosize": True, "margin": {"l": 64, "r": 16, "t": 48, "b": 40}, "plot_bgcolor": "#FAFAFA",
    "font": FONT}
"""The dashboard's look for the report's other charts (figure.py: FONT, plot_bgcolor)."""
DRAWN = (*SCALARS, "iteration_s")
"""Recorded series the dashboard's figure already draws (no second chart)."""
SUMMARY = ("iteration_ms", "engine_ms", "d2h_gbps_busy", "h2d_gbps_busy", "d2h_gbps_wall",
           "h2d_gbps_wall", "cpu_step_hidden_pct", "device_idle_pct", "exposed_optimizer_ms")
"""The summary's pooled figures, in this order."""
_STYLE = ("body{font-family:Arial,Helvetica,sans-serif;margin:1.2em 1.5em}"
          ".so-report-summary{font-size:14px;line-height:1.5}"
          ".so-report-chart{width:100%}"
          "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;"
          "padding:2px 8px;text-align:right}th{background:#f3f3f3}")


def _gather(source: Recorder | Sequence[Span], scalars: Mapping[str, ScalarSeries] | None
            ) -> tuple[list[Span], dict[str, list[tuple[int, float]]], list[tuple[int, str]],
                       IterationArchive | None]:
    notes: list[tuple[int, str]] = []
    series: dict[str, list[tuple[int, float]]] = {}
    archive = None
    if isinstance(source, Recorder):
        archive, spans = source.whole_run()
        for sc in source.scalars():
            series.setdefault(sc.name, []).append((sc.iteration, sc.value))
        notes = [(n.iteration, n.text) for n in source.notes()]
    else:
        spans = list(source)
        if any(not isinstance(s, Span) for s in spans):
            raise TypeError("write_html_report: pass a Recorder or a sequence of Span")
    for name, values in (scalars or {}).items():
        series[name] = [(int(i), float(v)) for i, v in values]
    return spans, series, notes, archive


def write_html_report(
    source: Recorder | Sequence[Span],
    path: str | Path,
    *,
    title: str,
    scalars: Mapping[str, ScalarSeries] | None = None,
    extra: Mapping[str, Any] | None = None,
    notes: Sequence[str] | None = None,
    timeline_iterations: int = 6,
    skip: int = 1,
    inline_js: bool = True,
) -> Path:
    """Write the report to `path` (parent folders are created) and return its path.

    scalars: extra per-iteration series {name: [(iteration, value), ...]}, e.g. {"lr": ...};
             they replace the recorder's series of the same name.
    extra:   the run's settings (model, device, ...), shown in a table at the end.
    notes:   plain-language events to list (added to a recorder's own notes).
    timeline_iterations: the timeline shows the last this-many iterations (bars stay legible).
    skip:    warm-up iterations left out of the summary's pooled figures.
    inline_js: embed plotly.js (the file opens alone, offline); False: write it beside.
    """
    if timeline_iterations < 1:
        raise ValueError(f"write_html_report: timeline_iterations={timeline_iterations} "
                         "must be >= 1")
    spans, series, recorded, archive = _gather(source, scalars)
    texts = [f"iteration {i}: {t}" for i, t in recorded] + list(notes or [])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = by_rank(spans)
    # metrics of one rank at a time; the summary is the lowest rank's, the table all ranks'
    per_iter = iteration_metrics(groups[min(groups)]) if groups else []
    summary = summarize_metrics(per_iter, skip=skip) if per_iter else None
    head = _summary(summary, series, texts, archive)
    tail = _tables_last(summary, extra or {}, summarize_by_rank(spans, skip=skip)
                        if len(groups) > 1 else {})
    try:
        import plotly  # noqa: F401  (optional: the "notebooks" extra)
    except ImportError:
        body = ("<p><b>plotly is not installed</b>, so this report has tables only; "
                "<code>pip install 'superoffload[notebooks]'</code> gives interactive charts.</p>"
                + head + _iteration_tables(per_iter, series) + tail)
        out.write_text(_page(title, body, script=""), encoding="utf-8")
        return out
    charts = _charts(spans, series, recorded, title, timeline_iterations, archive)
    out.write_text(_page(title, head + charts + tail, script=_plotly_script(out, inline_js)),
                   encoding="utf-8")
    return out


# ------------------------------------------------------------------ HTML pieces


def _page(title: str, body: str, *, script: str) -> str:
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title>{script}<style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{body}</body></html>\n")


def _plotly_script(out: Path, inline_js: bool) -> str:
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    if inline_js:
        return f"<script type='text/javascript'>{js}</script>"
    beside = out.parent / PLOTLY_JS
    if not beside.exists() or beside.stat().st_size != len(js.encode("utf-8")):
        beside.write_text(js, encoding="utf-8")
    return f"<script src='{PLOTLY_JS}'></script>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _kv_table(rows: Mapping[str, Any]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>"
                    for k, v in rows.items())
    return f"<table>{cells}</table>"


def _summary(summary: Summary | None, series: Mapping[str, list[tuple[int, float]]],
             notes: list[str], archive: IterationArchive | None = None) -> str:
    if summary is None:
        return "<p>No iterations were recorded (telemetry off, or no device spans).</p>"
    values = vocab.summary_values(summary)
    older = archive.iterations if archive is not None else 0
    count = (f"{summary.iterations + older} iterations ({older} of them binned: the recorder "
             "keeps the spans of the newest ones; the charts show them all)" if older
             else f"{summary.iterations} iterations")
    lines = [f"{count}; {summary.window_label()} pooled (after the "
             "warm-up; totals over totals): " + vocab.describe_values(values, SUMMARY[:2]),
             vocab.describe_values(values, SUMMARY[2:])]
    loss = series.get("loss")
    if loss:
        lines.append(f"loss {loss[0][1]:.4g} (iteration {loss[0][0]}) -> {loss[-1][1]:.4g} "
                     f"(iteration {loss[-1][0]})")
    lines.append(f"{summary.rollbacks_total} bucket rollbacks · {summary.replays_total} replays")
    body = "<br>".join(html.escape(t) for t in lines)
    out = f"<div class='so-report-summary'>{body}</div>"
    if notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in notes[-50:])
        out += f"<h2>Notes</h2><ul>{items}</ul>"
    return out


def _tables_last(summary: Summary | None, extra: Mapping[str, Any],
                 ranks: Mapping[int, Summary]) -> str:
    parts = []
    if extra:
        parts.append("<h2>Settings</h2>" + _kv_table(extra))
    if summary is not None:
        values = vocab.summary_values(summary)
        named = {vocab.METRICS[k].title: v for k, v in values.items() if not math.isnan(v)}
        parts.append(f"<h2>Per iteration, {summary.window_label()} pooled (totals for "
                     "counts)</h2><p>Definitions: "
                     "<code>superoffload/telemetry/vocabulary.py</code>.</p>" + _kv_table(named))
    if ranks:
        names = ["iteration_ms", "d2h_gbps_busy", "h2d_gbps_busy", "cpu_step_hidden_pct",
                 "device_idle_pct", "rollbacks"]
        head = "<th>rank</th>" + "".join(f"<th>{html.escape(vocab.METRICS[n].title)}</th>"
                                         for n in names)
        per_rank = {r: vocab.summary_values(sm) for r, sm in ranks.items()}
        rows = "".join(f"<tr><td>{r}</td>" + "".join(f"<td>{_fmt(values[n])}</td>" for n in names)
                       + "</tr>" for r, values in per_rank.items())
        parts.append(f"<h2>Per rank, pooled</h2><p>Each rank's own iterations (the charts and "
                     f"the summary are rank {min(ranks)}'s).</p>"
                     f"<table><tr>{head}</tr>{rows}</table>")
    return "".join(parts)


def _iteration_tables(per_iter: list[IterationMetrics],
                      series: Mapping[str, list[tuple[int, float]]]) -> str:
    names = [f.name for f in fields(IterationMetrics)]
    head = "".join(f"<th>{n}</th>" for n in names)
    rows = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in asdict(m).values()) + "</tr>"
                   for m in per_iter)
    out = f"<h2>Iterations</h2><table><tr>{head}</tr>{rows}</table>"
    for name, values in series.items():
        cells = "".join(f"<tr><td>{i}</td><td>{_fmt(v)}</td></tr>" for i, v in values)
        head = "<tr><th>iteration</th><th>value</th></tr>"
        out += f"<h2>{html.escape(name)}</h2><table>{head}{cells}</table>"
    return out


# ------------------------------------------------------------------ plotly charts


def _charts(spans: list[Span], series: Mapping[str, list[tuple[int, float]]],
            notes: list[tuple[int, str]], title: str, timeline_iterations: int,
            archive: IterationArchive | None) -> str:
    state = state_from(spans, series, notes, window_iterations=timeline_iterations,
                       max_points=PAGE_POINTS, archive=archive)
    dashboard = build_figure(title=f"{title} · the dashboard's view of the whole run")
    write_state(dashboard, state, dashboard["layout"]["title"]["text"])
    html_parts = [to_html(dashboard, config=PLOT_CONFIG, include_plotlyjs=False)]
    others = [_bandwidth(spans)]
    others += [_series_chart(name, values) for name, values in series.items()
               if name not in DRAWN and len({v for _, v in values}) > 1]
    html_parts += [f.to_html(full_html=False, include_plotlyjs=False, config=PLOT_CONFIG,
                             default_width="100%") for f in others if f is not None]
    return "".join(f"<div class='so-report-chart'>{part}</div>" for part in html_parts)


def _bandwidth(spans: list[Span]) -> Any:
    import plotly.graph_objects as go

    groups = by_rank(spans)
    if not any(s.nbytes for s in spans if s.lane in ("d2h", "h2d")):
        return None
    fig = go.Figure()
    multi = len(groups) > 1
    for rank, rank_spans in groups.items():
        for lane in ("d2h", "h2d"):
            t, gbps = bandwidth_series(rank_spans, lane)
            # D2H solid, H2D dashed: the two directions stay apart where their lines cross
            dash = "solid" if lane == "d2h" else "dash"
            line = {"shape": "hv", "color": L.METRIC_COLORS[lane], "dash": dash}
            fig.add_trace(go.Scatter(name=lane_label(lane.upper(), rank, multi), x=t, y=gbps,
                                     mode="lines", line=line))
    fig.update_layout(title="link traffic over time (each transfer's bytes spread over its span)",
                      xaxis_title="s since the recording started", yaxis_title="GB/s",
                      height=320, **_STYLE_LAYOUT)
    return fig


def _series_chart(name: str, values: list[tuple[int, float]]) -> Any:
    import plotly.graph_objects as go

    to, factor = vocab.ENGINE_SCALARS.get(name, (name, 1.0))
    metric = vocab.METRICS.get(to)
    label = metric.title if metric is not None else name
    fig = go.Figure(go.Scatter(name=label, x=[i for i, _ in values],
                               y=[v * factor for _, v in values], mode="lines",
                               line={"color": "#1B1B1B"}))
    fig.update_layout(title=f"{label} · {metric.definition}" if metric is not None else label,
                      xaxis_title="iteration", yaxis_title=label, height=280, **_STYLE_LAYOUT)
    return fig


__all__ = ["PLOTLY_JS", "write_html_report"]
