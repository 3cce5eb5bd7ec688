"""LiveDashboard without a browser: feed telemetry, assert the state and the figure's data."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import superoffload as so
from superoffload import plan
from superoffload.telemetry.events import LANES, Span
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.dashboard.marks import WAITING
from superoffload.widgets.dashboard.simulation import sim_figures, sim_panels
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.traces import TRACE
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared.plotjson import unpack
from superoffload.widgets.shared.runstate import RunState
from tests.widgets_support import FakeEngine, FigureView, filled_recorder, record_iteration

SHAPE = plan.ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=32, micro_batch=4)


def lane_counts(spans: list[Span]) -> dict[str, int]:
    return {lane: sum(1 for s in spans if s.lane == lane) for lane in LANES}


def visible_panels(fig) -> list[str]:  # type: ignore[no-untyped-def]
    return [k for k, s in L.AXIS.items() if fig.layout[f"xaxis{s}"].visible]


def test_refresh_draws_the_window_and_one_point_per_complete_iteration() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec, window_iterations=3)
    fig = FigureView(dash.figure)
    assert visible_panels(fig) == ["timeline"], "no panel before it has data"
    t = 0.0
    for it in range(8):
        t = record_iteration(rec, it, t, loss=5.0 - 0.1 * it) + 0.001
        dash.refresh()
    assert dash.figure is fig.to_plotly_json(), "the figure is created once and updated in place"
    assert len(fig.data) == len(TRACE)
    shown = [s for s in rec.spans() if s.iteration >= 5]
    for lane, n in lane_counts(shown).items():
        assert len(fig.data[TRACE[f"lane:{lane}"]].x) == 3 * n
    assert fig.data[TRACE["lane:device_compute"]].x[0] == 0.0, "ms since the window's start"
    # iterations 0..5 are complete (6 and 7 may still get late spans)
    assert list(fig.data[TRACE["d2h_gbps_busy"]].x) == list(range(6))
    want = list(dash.state.series()["iteration_ms"])
    assert list(fig.data[TRACE["iteration_ms"]].y) == pytest.approx(want)
    assert list(fig.data[TRACE["loss"]].y) == pytest.approx([5.0 - 0.1 * i for i in range(8)])
    assert visible_panels(fig)[:4] == ["timeline", "speed", "link", "percent"]
    assert fig.layout.xaxis3.matches == "x2" and fig.layout.xaxis4.matches == "x2"
    assert fig.layout.yaxis4.title.text == "%" and fig.layout.yaxis3.title.text == "GB/s (log)"
    assert fig.layout.yaxis3.type == "log" and fig.layout.yaxis2.range[0] == 0
    assert fig.layout.width is None and fig.layout.autosize, "the width follows the output area"
    assert dash.title_text() == "superoffload · iteration 7" and not fig.layout.title.text, \
        "the live figure's title is the status line above it"
    assert FigureView(dash.static_figure()[0]).layout.title.text == "superoffload · iteration 7"
    assert "<" not in dash.summary(), "no markup in text output"


def test_until_the_first_complete_iteration_the_figure_says_it_is_waiting() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec)
    record_iteration(rec, 0, 0.0)  # one iteration: not complete until the one after next starts
    dash.refresh()
    texts = [a.text for a in FigureView(dash.figure).layout.annotations]
    assert WAITING in texts, "not empty axes: the figure says what it waits for"
    lines = dash.status_lines()
    assert any(line.startswith("waiting for the first complete iteration") for line in lines)
    for it in (1, 2):
        record_iteration(rec, it, 0.034 * it)
    dash.refresh()
    assert WAITING not in [a.text for a in FigureView(dash.figure).layout.annotations]
    assert visible_panels(FigureView(dash.figure))[:2] == ["timeline", "speed"]


def test_the_link_peak_and_the_prediction_come_from_the_profile() -> None:
    engine = FakeEngine(iteration=6)
    for it in range(6):
        record_iteration(engine.telemetry, it, it * 0.034, loss=3.0)
    dash = LiveDashboard(engine, shape=SHAPE, profile="gh200")
    dash.refresh(final=True)
    for d in ("d2h", "h2d"):  # one line per direction, its own legend entry
        peak = FigureView(dash.figure).data[TRACE[f"{d}_peak"]]
        rate = getattr(plan.profiles.get("gh200"), f"{d}_gbps")
        assert set(np.asarray(peak.y, dtype=float)) == {rate}
        assert peak.name == f"planner's {d.upper()}"
    res = plan.simulate(SHAPE, plan.profiles.get("gh200"), config=engine.config)
    predicted = FigureView(dash.figure).data[TRACE["predicted_ms"]].y
    assert predicted[0] == pytest.approx(res.iteration_s * 1e3)
    assert "on profile gh200 (not calibrated; preset)" in dash.summary()
    # a reconfiguration: a new prediction step from its iteration, a marker on every panel
    engine.config = engine.config.replace(ratio=0.2)
    engine.telemetry.note(6, "reconfigure applied: ratio 0.9 -> 0.2")
    for it in range(6, 10):
        record_iteration(engine.telemetry, it, it * 0.034)
    engine.iteration = 10
    dash.refresh(final=True)
    pred = list(FigureView(dash.figure).data[TRACE["predicted_ms"]].y)
    res2 = plan.simulate(SHAPE, plan.profiles.get("gh200"), config=engine.config)
    assert pred[5] == pytest.approx(res.iteration_s * 1e3)
    assert pred[6] == pytest.approx(res2.iteration_s * 1e3)
    shapes = FigureView(dash.figure).layout.shapes
    assert {s.xref for s in shapes} >= {"x2", "x3", "x4"}
    assert all(s.x0 in (6, 6.0) or s.xref == "x" for s in shapes)
    assert any("ratio 0.9→0.2" in a.text for a in FigureView(dash.figure).layout.annotations)
    assert "it. 6: reconfigure applied: ratio 0.9 -> 0.2" in dash.summary()


def test_run_states_and_the_static_snapshot_at_the_end() -> None:
    rec = filled_recorder(4)
    dash = LiveDashboard(rec)
    dash.set_run_state(RunState.RUNNING)
    assert "running" in dash.title_text()
    dash.set_run_state(RunState.STOPPED)
    assert "stopped" in dash.title_text() and "running" not in dash.summary()
    assert list(dash.state.series()["iteration"]) == [0, 1, 2, 3], "the end refresh is final"
    bundle = dash._static_bundle()
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html", "text/plain"}
    assert bundle["application/vnd.plotly.v1+json"]["data"], "the figure itself, no kernel needed"
    assert "stopped" in bundle["text/plain"]


def test_rollbacks_replays_and_skipped_steps_are_marked_separately() -> None:
    rec = Recorder()
    t = 0.0
    for it in range(5):
        t = record_iteration(rec, it, t, rollback=(it == 2)) + 0.001
    rec.add("cpu_optimizer", "replay", 0.0705, 0.0706, iteration=2, bucket=0)
    rec.note(3, "overflow: non-finite gradient, step skipped; loss scale 1 -> 1")
    dash = LiveDashboard.from_spans(rec, title="stv")
    fig = FigureView(dash.figure)
    (rb,) = [s for s in rec.spans() if s.kind == "rollback"]
    assert list(fig.data[TRACE["rollback"]].x) == [pytest.approx((rb.start_s + rb.end_s) / 2 * 1e3)]
    # on the CPU lane's row, the rollback above its middle and the replay below: never on
    # top of each other
    row = LANES.index("cpu_optimizer")
    assert list(fig.data[TRACE["rollback"]].y) == [pytest.approx(row - 0.22)]
    assert list(fig.data[TRACE["replay"]].y) == [pytest.approx(row + 0.22)]
    assert len(fig.data[TRACE["skipped"]].x) == 1
    assert list(fig.data[TRACE["speed_rollback"]].x) == [2]
    assert list(fig.data[TRACE["speed_skipped"]].x) == [3]
    # on the iteration-time panel the events sit in a strip at the top, one row each, and
    # are the timeline legend's entries (one click hides an event everywhere)
    ys = {k: fig.data[TRACE[f"speed_{k}"]].y[0] for k in ("rollback", "replay", "skipped")}
    assert ys["rollback"] > ys["replay"] > ys["skipped"] > max(dash.state.series()["iteration_ms"])
    for k in ("rollback", "replay", "skipped"):
        speed, timeline = fig.data[TRACE[f"speed_{k}"]], fig.data[TRACE[k]]
        assert speed.legend == "legend" and speed.showlegend and not timeline.showlegend
        assert speed.legendgroup == timeline.legendgroup == k
    assert "1 bucket rollbacks · 1 replays · 1 skipped steps" in dash.summary()


def test_show_simulation_uses_the_simulated_layout() -> None:
    res = plan.simulate(SHAPE, plan.profiles.get("gh200"))
    dash = LiveDashboard(None)
    dash.show_simulation(res)
    figs = dash.sim
    assert sim_panels(figs) == ["timeline", "lanes", "link", "memory"]
    assert FigureView(dash.figure).layout.title.text.startswith("simulated")
    d2h = plan.profiles.get("gh200").d2h_gbps
    assert figs.link["d2h"].peak_gbps == d2h and figs.link["d2h"].gbps_busy <= d2h * 1.001
    assert [b.side for b in figs.memory] == ["device", "host"] and all(b.fits for b in figs.memory)
    assert all(figs.exposed_ms[lane] <= figs.busy_ms[lane] + 1e-9 for lane in figs.busy_ms)
    # ratio 0: nothing crosses the link, so no link panel
    gh200 = plan.profiles.get("gh200")
    none = sim_figures(plan.simulate(SHAPE, gh200, config=so.OffloadConfig(ratio=0.0)))
    assert "link" not in sim_panels(none)


@pytest.mark.parametrize("name, shape", [
    ("h100-sxm", SHAPE),  # eight GPUs share the host: one rank has an eighth of it
    ("gh200", plan.ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=32, micro_batch=4,
                              dp=4, ranks_per_host=4)),  # four ranks on one host
])
def test_simulated_memory_is_drawn_against_one_ranks_share_of_the_host(name, shape) -> None:
    from superoffload.plan.memory import DEVICE_HEADROOM, HOST_HEADROOM
    from superoffload.plan.parallel import rank_profile

    whole = plan.profiles.get(name)
    share = rank_profile(whole, shape.ranks_per_host)
    assert share.host_memory_bytes < whole.host_memory_bytes  # the case is a real split
    bars = {b.side: b for b in sim_figures(plan.simulate(shape, whole)).memory}
    assert bars["host"].usable_gb == pytest.approx(share.host_memory_bytes * HOST_HEADROOM / 1e9)
    assert bars["device"].usable_gb == pytest.approx(
        share.device_memory_bytes * DEVICE_HEADROOM / 1e9)


def test_a_simulation_that_does_not_fit_says_so_in_red() -> None:
    big = plan.ModelShape(layers=80, hidden=8192, heads=64, vocab=50257, seq=4096, micro_batch=8)
    dash = LiveDashboard(None)
    gh200 = plan.profiles.get("gh200")
    dash.show_simulation(plan.simulate(big, gh200, config=so.OffloadConfig(ratio=0.0)))
    assert dash.sim.problems and not all(b.fits for b in dash.sim.memory)
    texts = [a.text for a in FigureView(dash.figure).layout.annotations]
    assert any(t.startswith("<b>DOES NOT FIT</b>") for t in texts)
    assert any("DOES NOT FIT" in line for line in dash.status_lines())


def test_background_refresher_catches_up_and_stops(tmp_path) -> None:
    rec = Recorder()
    dash = LiveDashboard(rec).start(hz=50)
    assert dash.running
    t = 0.0
    for it in range(6):
        t = record_iteration(rec, it, t) + 0.001
    dash.stop()
    dash.refresh(final=True)
    assert not dash.running and dash.error is None
    assert dash.state.spans_seen == len(rec.spans())
    assert len(dash.state.series()["iteration"]) == 6
    text = dash.to_html(tmp_path / "dash.html").read_text()
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
    assert not dash.live and dash.widget is None, "no live widgets without plotly"
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


def test_device_memory_is_drawn_only_when_known() -> None:
    rec = Recorder()
    dash = LiveDashboard(rec)
    t = 0.0
    for it in range(4):
        t = record_iteration(rec, it, t, loss=5.0) + 0.001
    dash.refresh()
    device_mem = FigureView(dash.figure).data[TRACE["device_mem_gb"]].y
    assert len(device_mem) == 0, "CPU backend: no flat zero line"
    rec.scalar("device_mem_bytes", 3, 5e9)  # the engine's own figure when it records one
    dash.refresh(final=True)
    assert list(FigureView(dash.figure).data[TRACE["device_mem_gb"]].y)[-1] == pytest.approx(5.0)


def test_static_dashboards_accept_a_fake_simulation() -> None:
    sim = SimpleNamespace(
        timeline=[Span("device_compute", "forward", 0.0, 0.004, 0),
                  Span("d2h", "d2h", 0.001, 0.003, 0, 0, 8)],
        iteration_s=0.012, tflops=321.0, memory={"device": 2e9, "host": 5e9}, window=(0.0, 0.004),
        profile="gh200", problems=[])
    dash = LiveDashboard(None)
    dash.show_simulation(sim)
    assert FigureView(dash.figure).layout.title.text == (
        "simulated · 12.0 ms/iteration · 321 TFLOP/s · profile gh200")
    assert [b.needed_gb for b in dash.sim.memory] == [2.0, 5.0]


def test_the_live_view_is_a_one_way_widget_with_the_figure_in_one_trait() -> None:
    pytest.importorskip("anywidget")
    rec = filled_recorder(5, loss=3.0)
    dash = LiveDashboard(rec, live=True)
    assert dash.widget is not None and dash.plot in dash.widget.children
    # nothing the browser sends back is echoed: a busy kernel still hears the tuner
    assert dash.plot.trait_metadata("figure", "echo_update") is False
    assert "Plotly.react" in dash.plot._esm and len(dash.plot._esm) < 40_000, "plotly.js apart"
    dash.refresh()
    sent = dash.plot.figure
    assert set(sent) == {"json", "arrays"}, "the figure's JSON, its arrays as binary frames"
    assert all(isinstance(a, memoryview) for a in sent["arrays"]) and sent["arrays"]
    fig = unpack(sent)
    loss = TRACE["loss"]
    np.testing.assert_allclose(fig["data"][loss]["y"], dash.figure["data"][loss]["y"])
    # the live figure leaves its title to the status line above it (one screen at 1366x768)
    assert len(fig["data"]) == len(TRACE) and not fig["layout"]["title"]["text"]
    assert dash.status.value.startswith("<div class='so-dash-status'")
    assert "superoffload" in dash.status.value
    dash.refresh()  # nothing new: nothing sent
    assert dash.plot.figure is sent
    bundle = dash._static_bundle()  # what replaces the widget when the run ends
    assert bundle["application/vnd.plotly.v1+json"]["data"][TRACE["loss"]]["y"]


def test_labels_and_legends_do_not_cover_one_another() -> None:
    """Per-direction peaks, no invisible link-use lines, the change label on
    an opaque box at the panel's bottom (spikes never reach it), an A/B as one band."""
    engine = FakeEngine(iteration=30)
    t = 0.0
    for it in range(30):
        t = record_iteration(engine.telemetry, it, t, loss=3.0) + 0.001
    engine.telemetry.note(10, "A/B started: ratio 0.5 -> 0.8, 6 pairs of 4 iterations "
                              "(+1 settling per switch)")
    engine.telemetry.note(15, "reconfigure applied: ratio 0.5 -> 0.8")
    engine.telemetry.note(25, "A/B measured: ratio 0.5 -> 0.8: 33.00 -> 32.00 ms, change -3.0% "
                              "[-5.0%, -1.0%] (90% CI, 6 pairs of 4 iterations): faster")
    dash = LiveDashboard(engine, shape=SHAPE, profile="gh200")
    dash.refresh(final=True)
    fig = FigureView(dash.figure)
    percent = {s.name for s in fig.data if s.xaxis == "x4" and len(s.x)}
    assert percent == {"CPU step hidden", "device idle"}, "no 0.01 % lines on a 0-100 % axis"
    assert {s.name for s in fig.data if s.xaxis == "x3" and s.showlegend and len(s.x)} == \
        {"D2H", "H2D", "planner's D2H", "planner's H2D"}
    (label,) = [a for a in fig.layout.annotations if a.text.startswith("A/B ")]
    assert label.text == "A/B ratio 0.5→0.8" and label.yref == "y2 domain" and label.y < 0.1
    assert label.yanchor == "bottom" and label.bgcolor == "#FFFFFF", "opaque, at the bottom"
    bands = [s for s in fig.layout.shapes if s.type == "rect"]
    assert {s.xref for s in bands} >= {"x2", "x3", "x4"}
    assert {(s.x0, s.x1) for s in bands} == {(10, 25)}
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert not lines, "the switches inside the A/B are not lines"


def test_close_iteration_labels_and_link_numbers_stay_readable_in_the_simulated_layout() -> None:
    from superoffload.widgets.dashboard.simulation import build_sim_figure
    from superoffload.widgets.dashboard.timeline import spaced_labels

    assert spaced_labels({1: 0.0, 2: 3.0, 3: 40.0, 4: 41.0}, (0.0, 100.0)) == {1: 0.0, 3: 40.0}
    res = plan.simulate(SHAPE, plan.profiles.get("gh200"))
    fig = build_sim_figure(sim_figures(res))
    bars = [t for t in fig.data if t.type == "bar" and t.xaxis == "x3"]
    assert [b.x[0].split(" · ")[0] for b in bars] == ["D2H", "H2D"]
    assert all("GB/s" in b.x[0] and not b.text for b in bars), (
        "numbers under the axis, not on the bar")
    peaks = [t.name for t in fig.data if t.xaxis == "x3" and t.type == "scatter"]
    assert peaks == ["D2H peak", "H2D peak"]


def test_the_log_link_axis_spans_whole_decades_so_a_flat_rate_stays_flat() -> None:
    from superoffload.widgets.dashboard.plotdata import log_decades

    assert log_decades([np.array([2.0, 2.0000001])]) == [0.0, 1.0], "not its last digits blown up"
    assert log_decades([np.array([0.3, np.nan])], also=(23.1, None)) == [-1.0, 2.0]
    assert log_decades([np.array([np.nan])]) is None
    dash = LiveDashboard(filled_recorder(8), profile="gh200")
    dash.refresh(final=True)
    lo, hi = FigureView(dash.figure).layout.yaxis3.range
    rates = dash.state.series()["d2h_gbps_busy"]
    peak = plan.profiles.get("gh200").d2h_gbps
    assert 10 ** lo <= rates.min() and max(rates.max(), peak) <= 10 ** hi and hi - lo >= 1
