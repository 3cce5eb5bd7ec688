"""Per-rank telemetry: grouping, merging, files, per-rank metrics, per-rank lanes in
the dashboard figure and the static report. No browser: the figures' data is inspected."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from superoffload.telemetry import metrics, ranks
from superoffload.telemetry.events import LANE_LABELS, LANES, Span, lanes_in
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.dashboard.traces import TRACE
from tests.widgets_support import FigureView, record_iteration


def two_ranks(iterations: int = 4) -> tuple[Recorder, Recorder]:
    """Rank 0 and rank 1 with different schedules: rank 1's CPU step is 3x slower and it
    has 2 buckets instead of 3, so any mixing of ranks shows in the metrics."""
    r0, r1 = Recorder(rank=0), Recorder(rank=1)
    t0 = t1 = 0.0
    for it in range(iterations):
        t0 = record_iteration(r0, it, t0) + 0.001
        t1 = record_iteration(r1, it, t1, buckets=2) + 0.004
    return r0, r1


def test_recorder_spans_carry_their_rank_and_group_by_rank() -> None:
    r0, r1 = two_ranks()
    merged = ranks.merge_rank_spans([r0, r1])
    assert len(merged) == len(r0.spans()) + len(r1.spans())
    assert [s.start_s for s in merged] == sorted(s.start_s for s in merged)
    assert ranks.ranks_of(merged) == [0, 1]
    groups = ranks.by_rank(merged)
    assert sorted(groups[0], key=lambda s: (s.start_s, s.lane)) == \
        sorted(r0.spans(), key=lambda s: (s.start_s, s.lane))
    assert all(s.rank == 1 for s in groups[1])


def test_metrics_per_rank_equal_each_ranks_own_metrics() -> None:
    r0, r1 = two_ranks()
    merged = ranks.merge_rank_spans([r0, r1])
    per = ranks.iteration_metrics_by_rank(merged)
    assert per[0] == metrics.iteration_metrics(r0.spans())
    assert per[1] == metrics.iteration_metrics(r1.spans())
    # the ranks differ (3 vs 2 buckets of 4 MB D2H), so a mixed computation would show
    assert per[0][0].d2h_bytes == 12_000_000 and per[1][0].d2h_bytes == 8_000_000
    sums = ranks.summarize_by_rank(merged, skip=1)
    # each rank's own iterations after the warm-up, pooled (time per iteration: the mean)
    for r in (0, 1):
        after_first = [m.wall_s for m in per[r][1:]]
        assert sums[r].wall_s == pytest.approx(sum(after_first) / len(after_first))
    assert sums[1].wall_s > sums[0].wall_s


def test_merge_rejects_two_sources_with_one_rank_unless_ranks_are_given(tmp_path: Path) -> None:
    a, b = Recorder(), Recorder()  # both rank 0 (recorded without a rank)
    record_iteration(a, 0, 0.0)
    record_iteration(b, 0, 0.0)
    with pytest.raises(ValueError, match="both hold rank 0"):
        ranks.merge_rank_spans([a, b])
    merged = ranks.merge_rank_spans([a, b], ranks=[0, 3], offsets_s=[0.0, 0.5])
    assert ranks.ranks_of(merged) == [0, 3]
    shifted = [s for s in merged if s.rank == 3]
    assert min(s.start_s for s in shifted) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one rank per source"):
        ranks.merge_rank_spans([a, b], ranks=[0])


def test_gathered_files_round_trip(tmp_path: Path) -> None:
    r0, r1 = two_ranks(2)
    p0 = ranks.save_spans(r0.spans(), tmp_path / "spans-rank0.jsonl")
    p1 = ranks.save_spans(r1.spans(), tmp_path / "spans-rank1.jsonl")
    assert ranks.load_spans(p0) == r0.spans()
    merged = ranks.merge_rank_spans([p0, p1])
    assert merged == ranks.merge_rank_spans([r0, r1])
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([s.to_dict() for s in r1.spans()]))
    assert ranks.load_spans(as_list) == r1.spans()
    with pytest.raises(ValueError, match="lane='pcie'"):
        ranks.span_from_dict({**r0.spans()[0].to_dict(), "lane": "pcie"})


def test_lane_labels_and_rows() -> None:
    assert ranks.lane_label("d2h", 1, True) == "r1 d2h"
    assert ranks.lane_label("d2h", 1, False) == "d2h"
    rows = ranks.lane_rows([0, 1])
    assert rows[:len(LANES)] == [(0, lane) for lane in LANES] and len(rows) == 2 * len(LANES)
    s = Span("h2d", "h2d", 0.0, 1.0, 0, rank=1)
    assert ranks.row_index(s, [0, 1]) == len(LANES) + LANES.index("h2d")
    assert ranks.row_index(s, [1]) == LANES.index("h2d")  # one rank: rows as before


def test_dashboard_draws_per_rank_lanes_and_keeps_per_rank_points() -> None:
    pytest.importorskip("plotly")
    r0, r1 = two_ranks()
    merged = ranks.merge_rank_spans([r0, r1])
    dash = LiveDashboard.from_spans(merged, live=False)
    fig = FigureView(dash.figure)
    assert len(fig.data) == len(TRACE), "still one trace per lane: a fixed figure"
    labels = list(fig.layout.yaxis.ticktext)
    lanes = lanes_in(merged)  # the rows: the lanes the run used (no storage row here)
    assert "storage" not in lanes and len(lanes) == 5
    assert labels[0] == "r0 " + LANE_LABELS["device_compute"]
    assert labels[len(lanes) + 1] == "r1 " + LANE_LABELS["d2h"]
    assert len(labels) == 2 * len(lanes)
    d2h = fig.data[TRACE["lane:d2h"]]
    ys = np.asarray(d2h.y, dtype=float)
    n0 = sum(1 for s in merged if s.lane == "d2h" and s.rank == 0)
    n1 = sum(1 for s in merged if s.lane == "d2h" and s.rank == 1)
    assert np.sum(ys == lanes.index("d2h")) == 2 * n0
    assert np.sum(ys == len(lanes) + lanes.index("d2h")) == 2 * n1
    # per-rank metrics: each rank's series is its own, the plotted one is rank 0's
    for rank, rec in ((0, r0), (1, r1)):
        expected = metrics.iteration_metrics(rec.spans())
        got = dash.state.series(rank)
        assert list(got["iteration_ms"]) == pytest.approx([m.wall_s * 1e3 for m in expected])
        assert list(got["d2h_gbps_wall"]) == pytest.approx([m.d2h_gbps_wall for m in expected])
        assert list(got["d2h_gbps_busy"]) == pytest.approx([m.d2h_gbps_busy for m in expected])
    want = list(dash.state.series(0)["d2h_gbps_busy"])
    assert list(fig.data[TRACE["d2h_gbps_busy"]].y) == pytest.approx(want)
    assert "rank 1, iterations 0-" in dash.summary(), "one pooled line per rank"
    with pytest.raises(ValueError, match="ranks seen"):
        dash.state.series(7)


def test_single_rank_dashboard_is_unchanged() -> None:
    pytest.importorskip("plotly")
    r0, _ = two_ranks()
    dash = LiveDashboard.from_spans(r0.spans(), live=False)
    fig = FigureView(dash.figure)
    lanes = lanes_in(r0.spans())
    assert list(fig.layout.yaxis.ticktext) == [LANE_LABELS[x] for x in lanes]
    assert set(np.asarray(fig.data[TRACE["lane:h2d"]].y, dtype=float)[0::3]) == \
        {lanes.index("h2d")}
    assert "rank" not in dash.summary()


def _figure_data(text: str) -> list[list[dict]]:
    calls = re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', text, flags=re.S)
    return [json.loads(c) for c in calls]


def test_report_has_per_rank_lanes_and_a_per_rank_table(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    from superoffload.widgets.dashboard.report import write_html_report

    r0, r1 = two_ranks()
    out = write_html_report(ranks.merge_rank_spans([r0, r1]), tmp_path / "r.html", title="dp2")
    text = out.read_text()
    assert "Per rank, pooled" in text
    dashboard, bandwidth = _figure_data(text)[:2]
    new_plot = r'Plotly\.newPlot\(\s*"[^"]+",\s*\[.*?\],\s*(\{.*?\}),\s*\{"responsive"'
    layout = json.loads(re.search(new_plot, text, flags=re.S).group(1))  # type: ignore[union-attr]
    rows = set(layout["yaxis"]["ticktext"])  # the dashboard's timeline: a lane group per rank
    assert {"r0 D2H (grads out)", "r1 D2H (grads out)", "r0 CPU optimizer",
            "r1 device compute"} <= rows
    assert {t["name"] for t in bandwidth} == {"r0 D2H", "r0 H2D", "r1 D2H", "r1 H2D"}
    single = write_html_report(r0, tmp_path / "one.html", title="one").read_text()
    assert "Per rank, pooled" not in single
    assert "D2H" in {t["name"] for t in _figure_data(single)[1]}
