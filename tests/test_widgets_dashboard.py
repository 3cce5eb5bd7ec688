"""LiveDashboard without a browser: feed telemetry, assert the state and the figure's data."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry.events import LANES, Span
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets import _env
from superoffload.widgets.dashboard import LiveDashboard
from superoffload.widgets.figure import TRACE
from superoffload.widgets.series import DashboardState, span_segments
from tests.widgets_support import FakeEngine, filled_recorder, record_iteration


def lane_counts(spans: list[Span]) -> dict[str, int]:
    return {lane: sum(1 for s in spans if s.lane == lane) for lane in LANES}


def test_segments_encode_each_span_as_start_end_gap() -> None:
    spans = [Span("d2h", "d2h", 1.0, 1.5, 3, 0, 10), Span("d2h", "d2h", 2.0, 2.25, 3, 1, 10)]
    seg = span_segments(spans, lane_index=1)
    assert seg.count == 2
    np.testing.assert_array_equal(seg.x_s[[0, 1, 3, 4]], [1.0, 1.5, 2.0, 2.25])
    assert math.isnan(seg.x_s[2]) and math.isnan(seg.x_s[5])
    np.testing.assert_array_equal(seg.y[[0, 1, 3, 4]], [1, 1, 1, 1])
    assert seg.text[0].startswith("d2h it 3 bucket 0") and seg.text[2] == ""


def test_refresh_draws_the_last_window_of_iterations_and_one_point_per_finished_iteration() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec, window_iterations=3)
    fig = dash.figure
    t = 0.0
    for it in range(8):
        t = record_iteration(rec, it, t, loss=5.0 - 0.1 * it) + 0.001
        dash.refresh()
    assert dash.figure is fig, "the FigureWidget is created once and updated in place"
    assert len(fig.data) == len(TRACE)
    shown = [s for s in rec.spans() if s.iteration >= 5]
    for lane, n in lane_counts(shown).items():
        assert len(fig.data[TRACE[f"lane:{lane}"]].x) == 3 * n
    # iterations 0..6 are finished (7 is the newest, its window is still open)
    assert list(fig.data[TRACE["d2h_gbps"]].x) == list(range(7))
    expected = {m.iteration: m for m in metrics.iteration_metrics(rec.spans())}
    for it, gbps in zip(fig.data[TRACE["d2h_gbps"]].x, fig.data[TRACE["d2h_gbps"]].y):
        assert gbps == pytest.approx(expected[int(it)].d2h_gbps_wall, rel=1e-12)
    for it, frac in zip(fig.data[TRACE["overlap_frac"]].x, fig.data[TRACE["overlap_frac"]].y):
        assert frac == pytest.approx(expected[int(it)].cpu_overlap_frac, rel=1e-12)
    assert list(fig.data[TRACE["loss"]].y) == pytest.approx([5.0 - 0.1 * i for i in range(8)])
    assert len(fig.data[TRACE["host_mem_gb"]].x) == dash.refreshes == 8
    assert fig.layout.title.text.startswith("superoffload · iteration 7")


def test_final_refresh_closes_the_newest_iteration() -> None:
    rec = filled_recorder(4)
    dash = LiveDashboard(rec)
    dash.refresh()
    assert list(dash.state.series()["iteration"]) == [0, 1, 2]
    dash.refresh(final=True)
    assert list(dash.state.series()["iteration"]) == [0, 1, 2, 3]


def test_rollbacks_are_marked_and_counted() -> None:
    rec = Recorder()
    t = 0.0
    for it in range(4):
        t = record_iteration(rec, it, t, rollback=(it == 2)) + 0.001
    dash = LiveDashboard(rec, window_iterations=4)
    dash.refresh()
    marks = dash.figure.data[TRACE["rollback"]]
    (rb,) = [s for s in rec.spans() if s.kind == "rollback"]
    assert list(marks.x) == [pytest.approx((rb.start_s + rb.end_s) / 2)]
    assert list(marks.y) == [LANES.index("cpu_optimizer")]
    assert "1 rollbacks" in dash.title_text()


def test_title_reports_the_ratio_in_force_and_since_when() -> None:
    engine = FakeEngine(iteration=9)
    t = 0.0
    for it in range(9):
        t = record_iteration(engine.telemetry, it, t, ratio=0.9 if it < 6 else 0.5) + 0.001
    dash = LiveDashboard(engine)
    dash.refresh()
    assert dash.figure.layout.title.text == "superoffload · iteration 9 · ratio 0.50 (since it. 6)"


def test_title_falls_back_to_the_engine_config_without_ratio_scalars() -> None:
    engine = FakeEngine()
    engine.config = engine.config.replace(ratio=0.25)
    dash = LiveDashboard(engine)
    dash.refresh()
    assert "ratio 0.25" in dash.title_text()


def test_from_spans_draws_every_iteration_and_show_simulation_replaces_the_view() -> None:
    rec = filled_recorder(5)
    dash = LiveDashboard.from_spans(rec.spans(), title="run")
    assert dash.state.timeline_spans() == rec.spans()
    assert len(dash.state.series()["iteration"]) == 5
    sim = SimpleNamespace(
        timeline=[Span("device_compute", "forward", 0.0, 0.004, 0), Span("d2h", "d2h", 0.001, 0.003, 0, 0, 8)],
        iteration_s=0.012, tflops=321.0, memory=SimpleNamespace(device_bytes=2e9, host_bytes=5e9),
    )
    dash.show_simulation(sim)
    assert dash.figure.layout.title.text == "simulated · 12.0 ms/iteration · 321 TFLOPS"
    assert len(dash.figure.data[TRACE["lane:device_compute"]].x) == 3
    assert list(dash.figure.data[TRACE["device_mem_gb"]].y) == [2.0, 2.0]
    assert list(dash.figure.data[TRACE["host_mem_gb"]].y) == [5.0, 5.0]


def test_background_refresher_catches_up_and_stops(tmp_path) -> None:
    rec = Recorder()
    dash = LiveDashboard(rec).start(hz=50)
    assert dash.running
    t = 0.0
    for it in range(6):
        t = record_iteration(rec, it, t) + 0.001
    dash.stop()
    assert not dash.running and dash.error is None
    assert dash.state.spans_seen == len(rec.spans())
    assert len(dash.state.series()["iteration"]) == 6  # the last refresh is final
    page = dash.to_html(tmp_path / "dash.html")
    text = page.read_text()
    assert "plotly" in text and "iteration 5" in text


def test_outside_a_notebook_display_prints_a_summary_and_the_html_hint(capsys) -> None:
    dash = LiveDashboard(filled_recorder(3))
    dash.refresh()
    dash.display()
    out = capsys.readouterr().out
    assert "superoffload · iteration 2" in out
    assert "not in a notebook" in out and "to_html" in out


def test_without_plotly_it_explains_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setattr(_env, "has_module", lambda name: name not in ("plotly", "anywidget"))
    dash = LiveDashboard(filled_recorder(3))
    assert dash.figure is None and not dash.live
    dash.refresh()  # the state still follows the telemetry
    assert dash.state.spans_seen > 0
    dash.display()
    assert "needs plotly" in capsys.readouterr().out
    with pytest.raises(_env.WidgetsUnavailable, match="plotly"):
        dash.to_html("never.html")


def test_live_needs_anywidget(monkeypatch) -> None:
    monkeypatch.setattr(_env, "has_module", lambda name: name != "anywidget")
    with pytest.raises(_env.WidgetsUnavailable, match="anywidget"):
        LiveDashboard(Recorder(), live=True)
    assert LiveDashboard(Recorder()).live is False  # static figure instead


def test_bad_sources_and_rates_are_refused() -> None:
    with pytest.raises(TypeError, match="engine .*Recorder"):
        LiveDashboard(object())
    with pytest.raises(ValueError, match="refresh_hz"):
        LiveDashboard(Recorder(), refresh_hz=0)
    with pytest.raises(ValueError, match="window_iterations"):
        DashboardState(window_iterations=0)
    with pytest.raises(ValueError, match="no engine or recorder"):
        LiveDashboard.from_spans([]).start()


def test_device_memory_falls_back_to_device_resident_weight_bytes_without_cuda() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec)
    t = record_iteration(rec, 0, 0.0, loss=5.0)
    rec.scalar("device_weight_bytes", 0, 3e9)  # what weight-flow bounds by its prefetch depth
    record_iteration(rec, 1, t + 0.001, loss=4.9)
    dash.refresh()
    assert list(dash.figure.data[TRACE["device_mem_gb"]].y)[-1] == pytest.approx(3.0)
    rec.scalar("device_mem_bytes", 1, 5e9)  # the engine's own figure wins when it records one
    dash.refresh()
    assert list(dash.figure.data[TRACE["device_mem_gb"]].y)[-1] == pytest.approx(5.0)
