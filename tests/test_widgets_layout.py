"""The dashboard's pure logic without plotly or a browser: link rates and utilisation,
percentages, complete iterations only, the timeline in ms, layouts and palettes, status text."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry.events import LANES, Span
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.expected import Expected, predicted_at, prediction_gap
from superoffload.widgets.dashboard.state import DashboardState, IterationPoint
from superoffload.widgets.dashboard.status import (
    Workload,
    measured_arrays,
    robust_top,
    status_lines,
)
from superoffload.widgets.dashboard.timeline import span_segments, timeline_view, vlines
from superoffload.widgets.dashboard.traces import SPECS
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.runstate import RunState
from tests.widgets_support import MB, filled_recorder, record_iteration


def fed(iterations: int, *, final: bool = False, **kw) -> DashboardState:
    rec = filled_recorder(iterations, **kw)
    state = DashboardState(window_iterations=3)
    state.add_spans(rec.spans(), final=final)
    for name in ("loss", "ratio"):
        state.add_scalars(name, [(s.iteration, s.value) for s in rec.scalars(name)])
    return state


# ------------------------------------------------------------------ rates and percentages


def test_link_rate_is_bytes_over_time_moving_per_direction() -> None:
    # widgets_support: 3 buckets per iteration, D2H 4 MB in 2 ms each, H2D 2 MB in 1 ms each
    state = fed(4, final=True)
    s = state.series()
    assert s["d2h_gbps_busy"] == pytest.approx([12 * MB / 0.006 / 1e9] * 4)
    assert s["h2d_gbps_busy"] == pytest.approx([6 * MB / 0.003 / 1e9] * 4)
    m = metrics.iteration_metrics(filled_recorder(4).spans())
    assert s["d2h_gbps_wall"] == pytest.approx([x.d2h_bytes / x.wall_s / 1e9 for x in m])


def test_utilisation_is_wall_rate_over_peak_in_percent() -> None:
    state = fed(4, final=True)
    a = measured_arrays(state, Workload(d2h_peak_gbps=10.0, h2d_peak_gbps=5.0))
    assert a["d2h_link_use_pct"] == pytest.approx(100 * state.series()["d2h_gbps_wall"] / 10.0)
    assert a["h2d_link_use_pct"] == pytest.approx(100 * state.series()["h2d_gbps_wall"] / 5.0)
    assert metrics.link_utilisation_pct(3.0, None) != metrics.link_utilisation_pct(3.0, None)  # NaN
    assert math.isnan(measured_arrays(state, Workload())["d2h_link_use_pct"][0])


def test_overlap_and_idle_are_percent_and_overlap_is_a_gap_without_cpu_work() -> None:
    state = fed(3, final=True)
    s = state.series()
    m = metrics.iteration_metrics(filled_recorder(3).spans())
    assert s["cpu_step_hidden_pct"] == pytest.approx([100 * x.cpu_overlap_frac for x in m])
    assert s["device_idle_pct"] == pytest.approx([100 * x.device_idle_frac for x in m])
    no_cpu = DashboardState()
    no_cpu.add_spans([Span("device_compute", "forward", 0.0, 0.01, 0),
                      Span("device_compute", "forward", 0.02, 0.03, 1)], final=True)
    assert math.isnan(no_cpu.series()["cpu_step_hidden_pct"][0])  # not "100 % hidden"
    assert "link" not in no_cpu.available()


def test_tokens_and_tflops_per_second_and_the_prediction_step() -> None:
    state = fed(5, final=True)
    work = Workload(tokens_per_iteration=512, flops_per_iteration=2e12)
    expected = [Expected(0, 0.020, 50.0), Expected(3, 0.010, 100.0)]
    a = measured_arrays(state, work, expected)
    assert a["tokens_per_s"] == pytest.approx(512 / (a["iteration_ms"] / 1e3))
    assert a["tflops"] == pytest.approx(2.0 / (a["iteration_ms"] / 1e3))
    assert list(a["predicted_ms"]) == pytest.approx([20, 20, 20, 10, 10])
    assert math.isnan(predicted_at([Expected(2, 1.0, 1.0)], np.array([0.0, 2.0]))[0])


def test_only_complete_iterations_get_points() -> None:
    rec = filled_recorder(6)
    state = DashboardState()
    state.add_spans(rec.spans())
    # iteration i is complete once i + 2 has started: 0..3 of 0..5
    assert list(state.series()["iteration"]) == [0, 1, 2, 3]
    assert state.complete_through == 3
    # a late CPU span of iteration 4 still counts: its point is not out yet
    late = Span("cpu_optimizer", "cpu_step", 0.2, 0.3, 4, bucket=9, nbytes=0)
    record_iteration(rec, 6, 0.231)
    state.add_spans([late, *[s for s in rec.spans() if s.iteration == 6]])
    assert list(state.series()["iteration"]) == [0, 1, 2, 3, 4]
    state.add_spans([], final=True)
    assert list(state.series()["iteration"]) == [0, 1, 2, 3, 4, 5, 6]


def test_long_runs_keep_their_whole_history_at_an_even_coarser_step() -> None:
    state = DashboardState(max_points=10)
    state.add_spans(filled_recorder(40).spans(), final=True)
    s = state.series()
    # 40 iterations in <= 10 bins: the stride doubled twice (1 -> 4), every bin 4 wide
    assert state.stride() == 4 and len(s["iteration"]) == 10
    assert list(s["first"]) == list(range(0, 40, 4)) and list(s["last"]) == list(range(3, 40, 4))
    assert state.coverage() == (0, 39, 40)


def test_one_stall_does_not_flatten_the_iteration_time_axis() -> None:
    ms = np.full(100, 20.0)
    ms[50] = 900.0  # the machine stalled once
    assert robust_top(ms) == pytest.approx(30.0)
    assert robust_top(ms, also=np.array([np.nan, 40.0])) == pytest.approx(48.0)
    assert robust_top(np.array([np.nan])) is None


def test_an_ab_trial_is_one_event_and_its_result_is_shown_as_the_engine_wrote_it() -> None:
    state = fed(30, final=True)
    result = ("A/B measured: ratio 0.5 -> 0.8: 33.10 -> 31.90 ms, change -3.6% [-5.0%, -2.1%] "
              "(90% CI, 6 pairs of 4 iterations): faster; predicted -0.3% (outside the interval)")
    notes = [(10, "A/B started: ratio 0.5 -> 0.8, 6 pairs of 4 iterations "
                  "(+1 settling per switch)"),
             *[(15 + 5 * k, f"reconfigure applied: ratio {a} -> {b}")
               for k, (a, b) in enumerate([(0.5, 0.8), (0.8, 0.5)] * 2)]]
    state.add_notes(notes)
    running = status_lines(state, Workload(), [], run_state=RunState.RUNNING, iteration=30)
    assert "A/B running since it. 10: ratio 0.5 -> 0.8" in running[2]
    state.add_notes([*notes, (29, result)])
    assert state.reconfigures == [], "the switches inside a trial are not reconfigurations"
    (trial,) = state.ab_trials
    assert (trial.start, trial.end, trial.switches, trial.result) == (10, 29, 4, result)
    assert status_lines(state, Workload(), [], run_state=RunState.STOPPED, iteration=30)[2] \
        .endswith(f" · it. 10-29: {result}")


# ------------------------------------------------------------------ events and status


def test_rollbacks_replays_and_skipped_steps_are_counted_apart() -> None:
    rec = filled_recorder(2)
    rec.add("cpu_optimizer", "rollback", 1.0, 1.1, iteration=1, bucket=0)
    rec.add("cpu_optimizer", "rollback", 1.1, 1.2, iteration=1, bucket=1)
    rec.add("cpu_optimizer", "replay", 1.2, 1.3, iteration=1, bucket=0)
    state = DashboardState()
    state.add_spans(rec.spans(), final=True)
    state.add_notes([(1, "overflow: non-finite gradient, step skipped; loss scale 1 -> 1"),
                     (1, "reconfigure applied: ratio 0.5 -> 0.8")])
    assert (state.total_rollbacks, state.total_replays, state.skipped) == (2, 1, {1})
    assert state.reconfigures == [(1, "reconfigure applied: ratio 0.5 -> 0.8")]
    view = timeline_view(state.timeline_spans(), skipped=state.skipped,
                         reconfigures=state.reconfigures)
    assert (view.rollbacks.count, view.replays.count, view.skipped.count) == (2, 1, 1)
    lines = status_lines(state, Workload(), [], run_state=RunState.STOPPED, iteration=2)
    assert lines[2] == ("2 bucket rollbacks · 1 replays · 1 skipped steps · it. 1: reconfigure "
                         "applied: ratio 0.5 -> 0.8")
    assert lines[0] == "superoffload · stopped · iteration 2"
    assert not any("<" in line for line in lines), "plain text, no markup"


def test_status_says_measured_vs_predicted_and_which_profile() -> None:
    state = fed(8, final=True, ratio=0.5)
    work = Workload(tokens_per_iteration=512, flops_per_iteration=1e9, d2h_peak_gbps=40.0,
                    h2d_peak_gbps=40.0, profile_name="local-vm", profile_note="measured here",
                    micro_batches=2)
    lines = status_lines(state, work, [Expected(0, 0.030, 0.1)], run_state=RunState.RUNNING,
                         iteration=8)
    assert lines[0] == "superoffload · running · iteration 8 · ratio 0.50 (since it. 0)"
    # the key figures first, the window they pool named before them (telemetry.window)
    assert lines[1].startswith("iterations 0-7, pooled: iteration time 32.9 ms (predicted 30.0 ms, "
                               "not calibrated)"), lines[1]
    assert "tokens/s" in lines[1] and "CPU step hidden" in lines[1]
    text = "\n".join(lines)
    assert "predicted for 2 micro-batches: iteration time 30.0 ms" in text
    assert "profile local-vm (not calibrated; measured here)" in text
    assert "engine time 32.0 ms" in text, "the measurement the prediction is compared with"
    assert "TFLOP/s" in text
    # the reference rate is named for what it is (a preset's peak here; fitted: "fitted rate")
    assert "D2H link use" in text and "of the planner's 40.0 GB/s (peak)" in text
    assert not any(line.startswith("warning") for line in lines)  # 32 ms vs 30: close enough
    fitted_work = dataclasses.replace(work, d2h_peak_gbps=0.2, link_rate_kind="fitted")
    fitted = status_lines(state, fitted_work, [Expected(0, 0.030, 0.1)],
                          run_state=RunState.RUNNING, iteration=8)
    assert ("of the planner's 0.200 GB/s (fitted rate); moving at 10x that rate "
            "(a fit, not a bound)") in "\n".join(fitted), (
        "a measured rate above its reference is not called use of a peak")


def _steady(state: DashboardState, its: range, engine_ms: float) -> None:
    for it in its:
        state.add_point(IterationPoint(it, {"iteration_ms": engine_ms + 2.0,
                                            "engine_ms": engine_ms}, 0))


def test_the_prediction_gap_is_warned_only_after_warm_up_when_sustained_and_while_running() -> None:
    pred = [Expected(0, 0.010, 1.0)]  # 10 ms predicted
    state = DashboardState()
    _steady(state, range(0, 25), 50.0)  # 5x slower, but only 15 iterations after warm-up
    assert prediction_gap(state.recent()["iteration"], state.recent()["engine_ms"], pred) is None
    _steady(state, range(25, 30), 50.0)  # 20 after the warm-up's 10: two windows of 10
    gap = prediction_gap(state.recent()["iteration"], state.recent()["engine_ms"], pred)
    assert gap is not None and gap.factor == pytest.approx(5.0) and gap.iterations == 20
    running = status_lines(state, Workload(), pred, run_state=RunState.RUNNING, iteration=30)
    (warning,) = [line for line in running if line.startswith("warning:")]
    assert "5.0x the prediction for 20 iterations" in warning and "dash.calibrate()" in warning
    html = snap.html_lines(running)
    assert f"<span class='so-warning' style='{snap.WARNING_STYLE}'>warning:" in html  # coloured
    # after Stop the live warning is gone (it described a run that no longer goes)
    stopped = status_lines(state, Workload(), pred, run_state=RunState.STOPPED, iteration=30)
    assert not any(line.startswith("warning") for line in stopped)
    # a warm-up stall that came and went is not a gap: the older window is within the factor
    flicker = DashboardState()
    _steady(flicker, range(0, 20), 11.0)
    _steady(flicker, range(20, 30), 50.0)
    its, ms = flicker.recent()["iteration"], flicker.recent()["engine_ms"]
    assert prediction_gap(its, ms, pred) is None
    # a new prediction (a reconfiguration at 30) starts a new warm-up
    assert prediction_gap(state.recent()["iteration"], state.recent()["engine_ms"],
                          [*pred, Expected(30, 0.010, 1.0)]) is None


# ------------------------------------------------------------------ timeline


def test_timeline_is_in_ms_from_the_first_shown_iteration_with_boundaries() -> None:
    spans = filled_recorder(3).spans()
    view = timeline_view(spans)
    assert view.origin_s == 0.0
    assert view.boundaries == pytest.approx({0: 0.0, 1: 33.0, 2: 66.0})
    compute = view.lanes["device_compute"]
    assert compute.x_ms[0] == 0.0 and compute.x_ms[1] == pytest.approx(10.0)
    later = timeline_view([s for s in spans if s.iteration >= 1])
    assert later.boundaries[1] == 0.0 and later.x_range_ms[0] == 0.0
    x, y = vlines([1.0, 2.0], -0.5, 4.5)
    assert list(x[[0, 1, 3, 4]]) == [1, 1, 2, 2] and math.isnan(x[2]) and list(y[:2]) == [-0.5, 4.5]


def test_segments_encode_each_span_as_start_end_gap_in_ms() -> None:
    spans = [Span("d2h", "d2h", 1.0, 1.5, 3, 0, 10), Span("d2h", "d2h", 2.0, 2.25, 3, 1, 10)]
    seg = span_segments(spans, [1, 1], origin_s=1.0)
    assert seg.count == 2
    np.testing.assert_array_equal(seg.x_ms[[0, 1, 3, 4]], [0.0, 500.0, 1000.0, 1250.0])
    assert math.isnan(seg.x_ms[2]) and math.isnan(seg.x_ms[5])
    assert seg.text[0].startswith("d2h · it 3 · bucket 0") and seg.text[2] == ""


# ------------------------------------------------------------------ layout


def test_no_panel_without_data() -> None:
    assert L.measured_panels(frozenset()) == ["timeline"]
    assert L.measured_panels(frozenset({"loss", "speed"})) == ["timeline", "speed", "loss"]
    state = DashboardState()
    assert state.available() == frozenset()
    state.add_spans(filled_recorder(4).spans(), final=True)
    assert state.available() == {"speed", "percent", "link"}
    state.add_scalars("loss", [(0, 3.0)])
    state.add_memory(0, 1e9, None)
    assert state.available() == {"speed", "percent", "link", "loss", "memory"}
    assert not state.has_device_memory()


def test_grid_stacks_rows_and_every_panel_stays_inside_the_figure() -> None:
    panels = L.measured_panels(frozenset({"speed", "link", "percent", "loss", "memory"}))
    g = L.grid(panels, sizes=L.MEASURED_SIZES, legend_px=40)
    assert g.domains["timeline"].x == (0.0, 1.0)
    assert g.domains["speed"].y == g.domains["link"].y == g.domains["percent"].y  # 3 columns
    speed, link, percent = (g.domains[k].x for k in ("speed", "link", "percent"))
    assert speed[1] < link[0] < link[1] < percent[0]
    assert g.domains["loss"].y[1] < g.domains["speed"].y[0]  # below
    assert g.domains["loss"].x == g.domains["speed"].x, "a short last row keeps the column width"
    for d in g.domains.values():
        assert 0 <= d.x[0] < d.x[1] <= 1 and 0 < d.y[0] < d.y[1] < 1
    # a title band above each panel: nothing overlaps it; the legend's band above the timeline
    header = L.MEASURED_SIZES.header_px / g.height_px
    for key, d in g.domains.items():
        above = [o for k, o in g.domains.items() if o.y[0] > d.y[1] and
                 not (o.x[1] <= d.x[0] or o.x[0] >= d.x[1])]
        assert all(o.y[0] - d.y[1] >= header - 1e-6 for o in above), key
    assert 1 - g.domains["timeline"].y[1] >= (40 + L.MEASURED_SIZES.top_px) / g.height_px - 1e-6
    assert g.bottom_row == {"memory", "loss", "percent"}
    assert L.grid(["timeline", "speed"], sizes=L.MEASURED_SIZES).height_px < g.height_px
    # one screen at 1366x768 holds the status, the controls and the figure (the browser test
    # measures the rendered box); the figure itself stays well under the notebook's height
    assert g.height_px <= 560, g.height_px


def test_panels_can_be_hidden_and_the_legend_reserves_its_lines() -> None:
    everything = frozenset(L.MEASURED)
    shown = L.measured_panels(everything, hidden={"memory", "timeline"})
    assert shown == ["speed", "link", "percent", "loss"]
    with pytest.raises(ValueError, match="known panels"):
        L.measured_panels(everything, hidden={"speed", "throughput"})
    assert L.legend_lines(["a" * 10] * 3, 1000) == 1
    assert L.legend_lines(["a" * 50] * 3, 1000) == 2
    sim = L.grid(list(L.SIMULATED), full_width=("timeline", "memory"))
    assert L.legends_fit(L.SIMULATED, sim.domains, L.MIN_WIDTH_PX) == []
    long_name = "D2H (bytes / iteration time, while the link was busy)"
    too_long = {**L.SIMULATED, "link": L.Panel("link", "x", "GB/s", (long_name,) * 3)}
    assert L.legends_fit(too_long, sim.domains, L.MIN_WIDTH_PX) == ["link"]


def test_palettes_give_each_meaning_its_own_colour() -> None:
    # a lane has one colour wherever it is drawn: its timeline bars and its metric lines
    for metric, lane in L.LANE_OF_METRIC.items():
        assert L.METRIC_COLORS[metric] == L.LANE_COLORS[lane], metric
    prefixes = {"d2h_": "d2h", "h2d_": "h2d", "cpu_step": "cpu_optimizer",
                "device_idle": "device_compute"}
    for spec in SPECS:  # every line, band and compared run drawn of a lane's own figure
        lane = next((ln for p, ln in prefixes.items() if spec.metric.startswith(p)), None)
        if lane is not None and spec.kind != "peak":
            assert spec.color == L.LANE_COLORS[lane], (spec.key, spec.color)
    groups = [set(L.LANE_COLORS.values()), set(L.RUN_COLORS.values()), set(L.EVENT_COLORS.values()),
              {L.REFERENCE_COLOR}]
    every = [c.upper() for g in groups for c in g]
    assert len(every) == len(set(every)), "no colour means two things"
    assert len(L.LANE_COLORS) == len(LANES) == len(set(L.LANE_COLORS.values()))


def test_the_timeline_and_the_trace_draw_the_lanes_the_run_used() -> None:
    from superoffload.telemetry.events import LANE_LABELS, LANE_STORAGE, lanes_in
    from superoffload.telemetry.trace import chrome_trace

    plain = filled_recorder(3).spans()
    stored = [*plain, Span(LANE_STORAGE, "tier_read", 0.011, 0.013, 1, 0, 1_000_000),
              Span(LANE_STORAGE, "tier_write", 0.040, 0.042, 1, 0, 1_000_000)]
    assert LANE_STORAGE in LANES and LANE_LABELS[LANE_STORAGE] == "storage I/O"
    assert LANE_STORAGE not in lanes_in(plain) and lanes_in(stored)[-1] == LANE_STORAGE
    without, with_storage = timeline_view(plain), timeline_view(stored)
    assert "storage I/O" not in without.labels and without.rows == len(lanes_in(plain))
    assert with_storage.labels[-1] == "storage I/O" and with_storage.rows == without.rows + 1
    assert set(with_storage.lanes[LANE_STORAGE].y[0::3]) == {without.rows}, "its own row"

    def tracks(spans: list[Span]) -> set[str]:
        return {e["args"]["name"] for e in chrome_trace(spans)["traceEvents"]
                if e.get("name") == "thread_name"}

    assert "storage I/O" in tracks(stored) and "storage I/O" not in tracks(plain)
