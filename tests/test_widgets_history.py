"""A long run keeps its whole history: even bins whose stride doubles, each
with its minimum and maximum, so iteration 0 and a one-iteration spike survive; checked past
the series bound without training (2,000 recorded iterations, 3.3x the 600-point bound)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry.binned import Binned
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.dashboard.state import DashboardState, IterationPoint
from superoffload.widgets.dashboard.traces import TRACE
from tests.widgets_support import FigureView, record_iteration

ITERATIONS = 2000  # past the 600-point bound: the stride doubles twice (1 -> 4)
STALL_AT, STALL_S = 777, 0.050  # one iteration 50 ms slower than the others (~33 ms)
SPIKE_AT, SPIKE = 1234, 9.0     # one loss spike (the loss is 5 -> 2 elsewhere)


def long_run() -> Recorder:
    rec = Recorder()
    t = 0.0
    for it in range(ITERATIONS):
        loss = SPIKE if it == SPIKE_AT else 5.0 - 3.0 * it / ITERATIONS
        t = record_iteration(rec, it, t, loss=loss) + 0.001
        if it == STALL_AT:
            t += STALL_S  # the next iteration starts late: this one's window is longer
    return rec


def test_binned_doubles_its_stride_and_keeps_every_extreme() -> None:
    b = Binned(max_bins=8)
    values = [float(i % 5) for i in range(100)]
    values[37] = -7.0  # a dip
    values[61] = 99.0  # a spike
    for i, v in enumerate(values):
        b.add(i, v)
    a = b.arrays()
    assert b.stride == 16 and len(b) == 7, "100 iterations in bins of 16: 7 bins <= 8"
    assert list(a["first"]) == list(range(0, 100, 16)) and a["last"][-1] == 99
    assert int(a["n"].sum()) == b.count == 100, "every iteration counted once"
    assert b.extreme("max") == (61, 99.0) and b.extreme("min") == (37, -7.0)
    assert a["max"][61 // 16] == 99.0 and a["min"][37 // 16] == -7.0
    # the mean of each bin is the mean of its iterations (NaN-free here)
    assert a["mean"][0] == pytest.approx(np.mean(values[:16]))
    with pytest.raises(ValueError, match="max_bins"):
        Binned(max_bins=2)


def test_nan_values_are_counted_but_not_averaged() -> None:
    b = Binned(max_bins=4)
    for i, v in enumerate([1.0, math.nan, 3.0, math.nan]):
        b.add(i, v)
    a = b.arrays()
    assert list(a["mean"]) == [1.0, 3.0] or (a["mean"][0] == 1.0 and math.isnan(a["mean"][1]))
    only_nan = Binned(max_bins=4)
    only_nan.add(0, math.nan)
    assert math.isnan(only_nan.arrays()["max"][0]) and not only_nan.has_finite()


def test_a_state_fed_past_its_bound_keeps_the_whole_run_at_one_even_step() -> None:
    rec = long_run()
    state = DashboardState(window_iterations=4)
    for name in ("loss",):
        state.add_scalars(name, ((s.iteration, s.value) for s in rec.scalars(name)))
    state.add_spans(rec.spans(), final=True)
    s = state.series()
    # the history endpoints: iteration 0 and the last one are still there, counted once each
    assert state.coverage() == (0, ITERATIONS - 1, ITERATIONS)
    assert s["first"][0] == 0 and s["last"][-1] == ITERATIONS - 1
    # one even step over the whole run: every bin holds `stride` iterations (the last may be
    # partial), so the early run is as detailed as the late one
    stride = state.stride()
    assert stride == 4 and 300 <= len(s["iteration"]) <= 600
    assert set(s["n"][:-1]) == {stride} and np.all(np.diff(s["first"]) == stride)
    # the one slow iteration is its bin's maximum, at its value (not averaged away)
    m = {x.iteration: x for x in metrics.iteration_metrics(rec.spans())}
    k = STALL_AT // stride
    assert s["iteration_ms_max"][k] == pytest.approx(m[STALL_AT].wall_s * 1e3)
    assert s["iteration_ms_max"][k] > 2 * s["iteration_ms"][k - 1]
    assert state.history_by_rank[0]["iteration_ms"].extreme("max")[0] == STALL_AT
    # and the loss spike survives the binning of the loss too
    loss = state.loss_series()
    assert state.loss.stride == stride and loss["max"][SPIKE_AT // stride] == SPIKE
    assert loss["min"][-1] == pytest.approx(5.0 - 3.0 * (ITERATIONS - 1) / ITERATIONS)


def test_thousands_of_points_fed_without_spans_stay_bounded() -> None:
    """The CI path past the bound without training: 100,000 iterations of points."""
    state = DashboardState(max_points=600)
    for it in range(100_000):
        spike_ms = 50.0 if it == 31_337 else 0.0
        state.add_point(IterationPoint(it, {"iteration_ms": 10.0 + spike_ms}, 0))
    assert state.coverage() == (0, 99_999, 100_000)
    s = state.series()
    assert len(s["iteration"]) <= 600 and state.stride() == 256
    assert max(s["iteration_ms_max"]) == 60.0 and s["iteration_ms_min"].min() == 10.0
    assert len(state.recent()["iteration"]) == state.recent_points


def test_the_live_figure_and_the_static_one_draw_the_whole_run() -> None:
    rec = long_run()
    dash = LiveDashboard(rec, window_iterations=4)
    dash.refresh(final=True)
    fig = FigureView(dash.figure)
    line, band = fig.data[TRACE["iteration_ms"]], fig.data[TRACE["iteration_ms:band"]]
    assert len(line.x) <= 600 and line.x[0] == pytest.approx(1.5), "the first bin: 0..3"
    assert max(band.y) == pytest.approx(max(dash.state.series()["iteration_ms_max"]))
    titles = [fig.layout[f"xaxis{k}"].title.text or "" for k in "23456"]
    assert any(t == "iteration · bins of 4" for t in titles), titles
    status = dash.status_lines()
    assert any(line.startswith("history: iterations 0-1999 in bins of 4") for line in status)
    # the static figure re-reads the recorder at a finer bound: stride 2 for 2,000 iterations
    static, lines = dash.static_figure()
    static = FigureView(static)
    st = static.data[TRACE["iteration_ms"]]
    assert 1000 // 2 <= len(st.x) <= 1000 and st.x[0] == pytest.approx(0.5)
    assert max(static.data[TRACE["loss:band"]].y) == SPIKE
    assert any("bins of 2" in line for line in lines)


def test_arrays_rebuild_only_what_changed_and_match_a_full_rebuild() -> None:
    rng = np.random.default_rng(0)
    b = Binned(max_bins=16)
    for it in range(300):
        b.add(it, float(rng.normal()), weight=float(rng.uniform(0.5, 2.0)))
        if it % 7 == 0 or it > 290:
            got = b.arrays()
            fresh = Binned(max_bins=16)
            fresh.merge(b)  # the same bins, read once from scratch
            want = fresh.arrays()
            for col in want:
                np.testing.assert_array_equal(got[col], want[col], err_msg=f"{col} at {it}")


def test_an_archive_merges_bin_into_bin_at_the_coarser_stride() -> None:
    old, new = Binned(max_bins=8), Binned(max_bins=16)
    for it in range(64):  # the archive: iterations 0..63 at stride 8
        old.add(it, float(it))
    for it in range(64, 80):  # the live series: stride 1
        new.add(it, 1000.0)
    new.merge(old)
    a = new.arrays()
    assert new.stride == old.stride == 8 and len(new) == 10, "no more doubling than needed"
    assert a["first"][0] == 0 and a["last"][-1] == 79
    assert new.count == 80 and new.extreme("min") == (0, 0.0) and new.extreme("max")[1] == 1000.0
    pairs = zip(a["first"], a["last"])
    assert all(int(f) // new.stride == int(la) // new.stride for f, la in pairs)


def test_static_figure_csv_and_report_cover_a_run_longer_than_the_recorder_keeps(tmp_path) -> None:
    from superoffload.widgets.dashboard.report import write_html_report

    rec = Recorder(max_events=600)  # ~24 iterations of spans: the run is 50x longer, and
    t = 0.0                         # longer than the archive's 1,000 bins (it bins by 2)
    for it in range(1300):
        t = record_iteration(rec, it, t, loss=SPIKE if it == 3 else 5.0) + 0.001
        if it == 11:
            t += STALL_S
    assert rec.spans()[0].iteration > 1200
    dash = LiveDashboard.from_spans(rec, live=False)  # never watched the run live
    assert dash.state.coverage()[0] == 0, "its first read took the binned start too"
    fig, lines = dash.static_figure()
    line = FigureView(fig).data[TRACE["iteration_ms"]]
    assert line.x[0] <= 1.0 and line.x[-1] >= 1290, "the whole run: from its first iteration"
    band = FigureView(fig).data[TRACE["iteration_ms:band"]]
    assert max(band.y) >= (0.033 + STALL_S) * 1e3 * 0.99, "the start's stall is still there"
    assert max(FigureView(fig).data[TRACE["loss:band"]].y) == SPIKE, "and its loss spike"
    rows = dash.csv_text().splitlines()
    assert rows[1].startswith("0,") and int(rows[1].split(",")[1]) >= 1
    assert max(int(r.split(",")[1]) for r in rows[1:]) == 2, "the start: rows of 2 iterations"
    assert sum(int(r.split(",")[1]) for r in rows[1:]) == 1300, "every iteration counted once"
    page = write_html_report(rec, tmp_path / "report.html", title="long").read_text()
    assert "1300 iterations (" in page and "binned" in page
