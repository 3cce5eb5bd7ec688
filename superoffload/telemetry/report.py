"""A static HTML report of a run: timeline, link bandwidth, overlap/idle per iteration, loss.

    write_html_report(engine.telemetry, "runs/latest/report.html", title="GPT small, CPU")

plotly is optional (the "notebooks" extra) and imported lazily. With plotly the report holds
four interactive charts; plotly.js is written ONCE beside the report as `plotly.min.js`
(4.8 MB, works offline, no CDN) or, with `inline_js=True`, embedded in the file. Without
plotly the report is plain HTML tables and says how to get the charts.

Several data-parallel ranks (spans with different `rank`, e.g. `ranks.merge_rank_spans`): the
timeline has one group of lanes per rank ("r0 d2h", "r1 d2h", ...), the bandwidth chart one
line per rank and direction, and a "Per-rank medians" table; the per-iteration charts and the
header medians are the lowest rank's (metrics are never computed over mixed ranks).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from superoffload.telemetry.events import KIND_REPLAY, KIND_ROLLBACK, KIND_WAIT, LANES, Span
from superoffload.telemetry.metrics import (
    IterationMetrics,
    Summary,
    bandwidth_series,
    iteration_metrics,
    summarize_metrics,
)
from superoffload.telemetry.ranks import by_rank, lane_label, lane_rows, summarize_by_rank
from superoffload.telemetry.recorder import Recorder

ScalarSeries = Sequence[tuple[int, float]]
PLOTLY_JS = "plotly.min.js"

# one colour per kind, rollback/replay in red so they stand out on the timeline
_COLOURS = {
    "forward": "#4C78A8", "backward": "#72B7B2", "d2h": "#F58518", "h2d": "#54A24B",
    "cpu_step": "#B279A2", "device_step": "#9D755D", "validate": "#BAB0AC",
    "rollback": "#E45756", "replay": "#FF9DA6", "wait": "#DDDDDD", "weight_fetch": "#EECA3B",
}


def _gather(
    source: Recorder | Sequence[Span], scalars: Mapping[str, ScalarSeries] | None
) -> tuple[list[Span], dict[str, list[tuple[int, float]]], list[str]]:
    notes: list[str] = []
    series: dict[str, list[tuple[int, float]]] = {}
    if isinstance(source, Recorder):
        spans = source.spans()
        for sc in source.scalars():
            series.setdefault(sc.name, []).append((sc.iteration, sc.value))
        notes = [f"iteration {n.iteration}: {n.text}" for n in source.notes()]
    else:
        spans = list(source)
        if any(not isinstance(s, Span) for s in spans):
            raise TypeError("write_html_report: pass a Recorder or a sequence of Span")
    for name, values in (scalars or {}).items():
        series[name] = [(int(i), float(v)) for i, v in values]
    return spans, series, notes


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
    inline_js: bool = False,
) -> Path:
    """Write the report to `path` (parent folders are created) and return its path.

    scalars: extra per-iteration series {name: [(iteration, value), ...]}, e.g. {"loss": ...};
             they replace the recorder's series of the same name.
    extra:   key/value pairs shown in the header table (model, device, tokens/s...).
    notes:   plain-language events to list (added to a recorder's own notes).
    timeline_iterations: the timeline shows the last this-many iterations (bars stay legible).
    skip:    warm-up iterations left out of the summary medians.
    """
    if timeline_iterations < 1:
        raise ValueError(f"write_html_report: timeline_iterations={timeline_iterations} must be >= 1")
    spans, series, recorded_notes = _gather(source, scalars)
    notes = [*recorded_notes, *(notes or [])]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = by_rank(spans)
    # metrics of one rank at a time; the header shows the lowest rank's, the table all ranks'
    per_iter = iteration_metrics(next(iter(groups.values()))) if len(groups) > 1 else \
        iteration_metrics(spans)
    summary = summarize_metrics(per_iter, skip=skip) if per_iter else None
    head = _header(title, summary, extra or {}, notes)
    if len(groups) > 1:
        head += _rank_table(summarize_by_rank(spans, skip=skip))
    try:
        import plotly  # noqa: F401  (optional: the "notebooks" extra)
    except ImportError:
        body = (
            "<p><b>plotly is not installed</b>, so this report has tables only; "
            "<code>pip install 'superoffload[notebooks]'</code> gives interactive charts.</p>"
            + _tables(per_iter, series)
        )
        out.write_text(_page(title, head + body, script=""), encoding="utf-8")
        return out
    charts = _charts(spans, per_iter, series, timeline_iterations)
    script = _plotly_script(out, inline_js)
    out.write_text(_page(title, head + charts, script=script), encoding="utf-8")
    return out


# ------------------------------------------------------------------ HTML pieces


def _page(title: str, body: str, *, script: str) -> str:
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>{script}"
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1200px}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;"
        "padding:2px 8px;text-align:right}th{background:#f3f3f3}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


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
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def _header(title: str, summary: Summary | None, extra: Mapping[str, Any], notes: list[str]) -> str:
    parts = []
    if extra:
        parts.append("<h2>Run</h2>" + _kv_table(extra))
    if summary is not None:
        parts.append(
            "<h2>Per-iteration medians</h2><p>Link GB/s: <i>busy</i> = bytes / time the link "
            "was moving, <i>wall</i> = bytes / iteration time. Exposed optimizer time = "
            "optimizer work after backward that the device did not hide behind compute.</p>"
            + _kv_table(summary.to_dict())
        )
    else:
        parts.append("<p>No iterations were recorded (telemetry off, or no device spans).</p>")
    if notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in notes[-50:])
        parts.append(f"<h2>Notes</h2><ul>{items}</ul>")
    return "".join(parts)


def _rank_table(summaries: Mapping[int, Summary]) -> str:
    names = ["wall_s", "compute_s", "device_idle_frac", "cpu_overlap_frac", "exposed_optimizer_s",
             "d2h_gbps_busy", "h2d_gbps_busy", "rollbacks_total"]
    head = "<th>rank</th>" + "".join(f"<th>{n}</th>" for n in names)
    rows = "".join(
        f"<tr><td>{r}</td>" + "".join(f"<td>{_fmt(getattr(sm, n))}</td>" for n in names) + "</tr>"
        for r, sm in summaries.items())
    return ("<h2>Per-rank medians</h2><p>Each rank's own iterations (data parallel: the "
            f"header above is rank {min(summaries)}'s).</p><table><tr>{head}</tr>{rows}</table>")


def _tables(per_iter: list[IterationMetrics], series: Mapping[str, list[tuple[int, float]]]) -> str:
    names = [f.name for f in fields(IterationMetrics)]
    head = "".join(f"<th>{n}</th>" for n in names)
    rows = "".join(
        "<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in asdict(m).values()) + "</tr>"
        for m in per_iter
    )
    out = f"<h2>Iterations</h2><table><tr>{head}</tr>{rows}</table>"
    for name, values in series.items():
        cells = "".join(f"<tr><td>{i}</td><td>{_fmt(v)}</td></tr>" for i, v in values)
        out += f"<h2>{html.escape(name)}</h2><table><tr><th>iteration</th><th>value</th></tr>{cells}</table>"
    return out


# ------------------------------------------------------------------ plotly charts


def _charts(
    spans: list[Span],
    per_iter: list[IterationMetrics],
    series: Mapping[str, list[tuple[int, float]]],
    timeline_iterations: int,
) -> str:
    import plotly.graph_objects as go

    divs = []
    # 1. timeline of the last iterations: lanes as rows, one bar trace per kind
    shown = sorted({s.iteration for s in spans})[-timeline_iterations:]
    shown_set = set(shown)
    recent = [s for s in spans if s.iteration in shown_set]
    ranks = sorted({s.rank for s in spans})
    multi = len(ranks) > 1
    timeline = go.Figure()
    for kind in sorted({s.kind for s in recent}):
        group = [s for s in recent if s.kind == kind]
        timeline.add_trace(go.Bar(
            name=kind, orientation="h", y=[lane_label(s.lane, s.rank, multi) for s in group],
            base=[s.start_s * 1e3 for s in group], x=[s.duration_s * 1e3 for s in group],
            marker={"color": _COLOURS.get(kind, "#888"),
                    "line": {"width": 2 if kind in (KIND_ROLLBACK, KIND_REPLAY) else 0,
                             "color": "#B00"}},
            opacity=0.5 if kind == KIND_WAIT else 1.0,
            customdata=[[s.iteration, s.bucket, s.nbytes / 1e6] for s in group],
            hovertemplate=f"{kind}<br>iteration %{{customdata[0]}}, bucket %{{customdata[1]}}"
                          "<br>%{base:.2f} ms + %{x:.2f} ms<br>%{customdata[2]:.2f} MB<extra></extra>",
        ))
    marks = [s for s in recent if s.kind in (KIND_ROLLBACK, KIND_REPLAY)]
    if marks:
        timeline.add_trace(go.Scatter(
            name="rollback/replay", mode="markers", x=[s.start_s * 1e3 for s in marks],
            y=[lane_label(s.lane, s.rank, multi) for s in marks],
            marker={"symbol": "x", "size": 12, "color": "#B00"}))
    rows = [lane_label(lane, r, multi) for r, lane in lane_rows(ranks)] if multi else list(LANES)
    timeline.update_layout(
        title=f"Timeline of iterations {shown[0]}..{shown[-1]}" if shown else "Timeline (empty)",
        barmode="overlay", xaxis_title="ms since the recording started",
        height=380 + 200 * (len(ranks) - 1),
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows))})
    divs.append(timeline)

    # 2. link bandwidth over the whole run
    bw = go.Figure()
    for rank, rank_spans in (by_rank(spans).items() if multi else [(0, spans)]):
        for lane in ("d2h", "h2d"):
            t, gbps = bandwidth_series(rank_spans, lane)
            bw.add_trace(go.Scatter(name=lane_label(lane, rank, multi), x=[x for x in t], y=gbps,
                                    mode="lines", line={"shape": "hv"}))
    bw.update_layout(title="Link bandwidth over time (bytes spread over each transfer)",
                     xaxis_title="s since the recording started", yaxis_title="GB/s", height=320)
    divs.append(bw)

    # 3. link rate while moving (per direction), then overlap and idle in percent, per iteration
    its = [m.iteration for m in per_iter]
    link = go.Figure()
    for direction, rates in (("D2H", [m.d2h_gbps_busy if m.d2h_bytes else None for m in per_iter]),
                             ("H2D", [m.h2d_gbps_busy if m.h2d_bytes else None for m in per_iter])):
        link.add_trace(go.Scatter(name=direction, x=its, y=rates, mode="lines"))
    link.update_layout(title="Link rate while moving, per iteration (bytes / time the link was busy)",
                       xaxis_title="iteration", yaxis_title="GB/s", height=320)
    divs.append(link)
    ov = go.Figure()
    ov.add_trace(go.Scatter(name="CPU step hidden under device work", x=its,
                            y=[100 * m.cpu_overlap_frac if m.cpu_step_s > 0 else None for m in per_iter]))
    ov.add_trace(go.Scatter(name="device idle", x=its, y=[100 * m.device_idle_frac for m in per_iter]))
    ov.add_trace(go.Scatter(name="CPU busy", x=its, y=[100 * m.cpu_busy_frac for m in per_iter]))
    ov.add_trace(go.Scatter(name="exposed optimizer / iteration time", x=its,
                            y=[100 * m.exposed_optimizer_s / m.wall_s if m.wall_s else 0.0 for m in per_iter]))
    ov.update_layout(title="Overlap and idle per iteration", xaxis_title="iteration",
                     yaxis={"range": [0, 105], "title": "%"}, height=320)
    divs.append(ov)

    # 4. scalars: loss first, then the rest (each on its own axis would crowd: one chart each)
    for name in sorted(series, key=lambda n: (n != "loss", n)):
        values = series[name]
        if len({v for _, v in values}) <= 1:
            continue  # constant (or empty): listed in the table below instead of a flat line
        fig = go.Figure(go.Scatter(name=name, x=[i for i, _ in values], y=[v for _, v in values],
                                   mode="lines"))
        fig.update_layout(title=name, xaxis_title="iteration", height=280)
        divs.append(fig)
    config = {"displaylogo": False, "responsive": True}
    flat = {name: values[0][1] for name, values in series.items() if len({v for _, v in values}) == 1}
    tail = "<h2>Constant series</h2>" + _kv_table(flat) if flat else ""
    return "".join(f.to_html(full_html=False, include_plotlyjs=False, config=config)
                   for f in divs) + tail

