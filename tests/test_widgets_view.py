"""What a W&B or TensorBoard user reaches for, without a browser: smoothing, a wall-clock axis,
hidden panels, runs compared on the same axes (saved ones and the before/after of a change),
CSV of every series; the toolbar's controls do what the dashboard's methods do."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.csvfile import metrics_csv
from superoffload.telemetry.recorder import Recorder
from superoffload.telemetry.runfile import list_runs, load_run, save_run
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.compare import BEFORE_AFTER
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.dashboard.options import ViewOptions
from superoffload.widgets.dashboard.smoothing import ema
from superoffload.widgets.dashboard.traces import TRACE
from tests.widgets_support import FakeEngine, FigureView, record_iteration

pytest.importorskip("plotly")


def run(iterations: int, *, loss0: float = 5.0, stretch: float = 0.0, rec: Recorder | None = None,
        start_it: int = 0, t: float = 0.0) -> Recorder:
    """A recorder of `iterations` iterations; `stretch` adds that much idle time to each."""
    rec = rec or Recorder()
    for it in range(start_it, start_it + iterations):
        t = record_iteration(rec, it, t, loss=loss0 - 0.01 * it) + 0.001 + stretch
    return rec


def visible(fig) -> list[str]:  # type: ignore[no-untyped-def]
    return [k for k, s in L.AXIS.items() if fig.layout[f"xaxis{s}"].visible]


def test_ema_is_tensorboards_debiased_average_and_skips_gaps() -> None:
    values = np.array([1.0, 3.0, np.nan, 2.0, 6.0])
    w = 0.6
    got = ema(values, w)
    last, k, want = 0.0, 0, []
    for v in values:  # the rule written out (TensorBoard's scalar card)
        if math.isnan(v):
            want.append(math.nan)
            continue
        last, k = w * last + (1 - w) * v, k + 1
        want.append(last / (1 - w ** k))
    np.testing.assert_allclose(got, want, equal_nan=True)
    assert got[0] == 1.0, "debiased: the first point is not pulled towards 0"
    np.testing.assert_array_equal(ema(values, 0.0), values)
    with pytest.raises(ValueError, match="between 0"):
        ema(values, 1.0)
    with pytest.raises(ValueError, match="x_axis"):
        ViewOptions(x_axis="time")
    with pytest.raises(ValueError, match="panels are"):
        ViewOptions(hidden=frozenset({"throughput"}))


def test_smoothing_hiding_and_the_wall_clock_axis_change_the_figure_not_the_data() -> None:
    rec = run(40, stretch=0.0)
    record_iteration(rec, 40, 40 * 0.033 + 2.0)  # a 2 s gap before the last iteration
    dash = LiveDashboard(rec, live=False)
    dash.refresh(final=True)
    fig = FigureView(dash.figure)
    raw = np.asarray(fig.data[TRACE["iteration_ms"]].y, dtype=float)
    dash.set_view(smoothing=0.9)
    line = fig.data[TRACE["iteration_ms"]]
    np.testing.assert_allclose(np.asarray(line.y, dtype=float), ema(raw, 0.9))
    np.testing.assert_allclose(np.asarray(line.customdata)[:, 4].astype(float), raw), "hover: raw"
    np.testing.assert_allclose(np.asarray(fig.data[TRACE["loss"]].y, dtype=float),
                               ema(dash.state.loss_series()["mean"], 0.9))
    dash.set_view(hidden={"link", "timeline"})
    assert visible(fig) == ["speed", "percent", "loss", "memory"]
    dash.set_view(hidden=(), x_axis="wall clock")
    assert visible(fig)[0] == "timeline"
    x = np.asarray(fig.data[TRACE["iteration_ms"]].x, dtype=float)
    starts = [m.start_s for m in metrics.iteration_metrics(rec.spans())]
    np.testing.assert_allclose(x, [s - starts[0] for s in starts[:len(x)]])
    assert x[-1] > 3.0, "the wall clock shows the 2 s gap an iteration axis hides"
    assert fig.layout.xaxis2.title.text == "" and "s since the run started" in \
        [fig.layout[f"xaxis{s}"].title.text for s in "23456"]
    static = FigureView(dash.static_figure()[0])  # the snapshot keeps the view on screen
    assert static.data[TRACE["iteration_ms"]].x[-1] == pytest.approx(x[-1])


def test_a_saved_run_loads_back_and_compares_on_the_same_axes(tmp_path: Path) -> None:
    slow = run(30, stretch=0.010, loss0=6.0)
    folder = save_run(slow, tmp_path / "runs" / "slow", meta={"ratio": 0.5})
    loaded = load_run(folder)
    assert loaded.name == "slow" and loaded.metrics == metrics.iteration_metrics(slow.spans())
    assert loaded.scalars["loss"][0] == (0, 6.0)
    assert list_runs(tmp_path / "runs") == [folder]
    with pytest.raises(ValueError, match="holds other files"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep me")
        save_run(slow, tmp_path / "mine")

    live = run(25, start_it=0)
    dash = LiveDashboard(live, live=False)
    dash.refresh(final=True)
    assert dash.compare(folder) == ["slow"]
    fig = FigureView(dash.figure)
    line = fig.data[TRACE["run0:iteration_ms"]]
    assert line.name == "slow" and line.showlegend and list(line.x)[0] == 0.0
    assert np.nanmean(np.asarray(line.y, dtype=float)) > np.nanmean(
        np.asarray(fig.data[TRACE["iteration_ms"]].y, dtype=float)) + 5, "the slower run is above"
    assert list(fig.data[TRACE["run0:loss"]].y)[0] == 6.0
    assert not len(fig.data[TRACE["run1:iteration_ms"]].x), "unused slots stay empty"
    assert "each run from its own start" in " ".join(
        fig.layout[f"xaxis{s}"].title.text or "" for s in "23456")
    dash.compare()
    assert not len(fig.data[TRACE["run0:iteration_ms"]].x)
    with pytest.raises(ValueError, match="no run.json"):
        dash.compare(tmp_path)


def test_a_superoffload_train_folder_is_a_run_too(tmp_path: Path) -> None:
    rec = run(6)
    records = metrics.to_records(rec.spans())
    for r in records:  # a result.json written before cpu_hidden_s existed
        r.pop("cpu_hidden_s")
    (tmp_path / "result.json").write_text(json.dumps({"steps": 6, "iterations": records}))
    got = load_run(tmp_path)
    want = metrics.iteration_metrics(rec.spans())
    assert [m.iteration for m in got.metrics] == [m.iteration for m in want]
    assert got.metrics[2].cpu_hidden_s == pytest.approx(want[2].cpu_hidden_s)


def test_before_and_after_a_change_are_two_runs_from_zero() -> None:
    engine = FakeEngine(iteration=0)
    t = 0.0
    for it in range(40):
        slower_s = 0.02 if it >= 20 else 0.0
        t = record_iteration(engine.telemetry, it, t, loss=3.0) + 0.001 + slower_s
    engine.telemetry.note(20, "reconfigure applied: ratio 0.5 -> 0.8")
    engine.iteration = 40
    dash = LiveDashboard(engine, live=False, calibrate_after=None)
    dash.refresh(final=True)
    dash.compare(BEFORE_AFTER)
    fig = FigureView(dash.figure)
    before, after = fig.data[TRACE["run0:iteration_ms"]], fig.data[TRACE["run1:iteration_ms"]]
    assert before.name.startswith("before ratio 0.5 -> 0.8 (it. 1-19)"), before.name
    assert after.name == "after (it. 21-39)" and list(before.x)[0] == list(after.x)[0] == 0.0
    assert np.nanmedian(np.asarray(after.y, dtype=float)) == pytest.approx(
        np.nanmedian(np.asarray(before.y, dtype=float)) + 20.0, abs=1.0), "20 ms slower after"


def test_the_csv_holds_every_series_of_every_iteration(tmp_path: Path) -> None:
    rec = run(12)
    dash = LiveDashboard(rec, live=False)
    dash.refresh(final=True)
    path = dash.to_csv(tmp_path / "m.csv")
    rows = [line.split(",") for line in path.read_text().splitlines()]
    head, body = rows[0], rows[1:]
    assert head == ["iteration", "iterations", "time_s", *vocab.PER_ITERATION, "loss"]
    want = metrics.iteration_metrics(rec.spans())
    assert [int(r[0]) for r in body] == [m.iteration for m in want]
    for r, m in zip(body, want):
        values = vocab.iteration_values(m)
        assert r[1] == "1", "one row per iteration while the recorder holds its spans"
        for name, cell in zip(vocab.PER_ITERATION, r[3:]):
            assert (cell == "") if math.isnan(values[name]) else float(cell) == values[name], name
    assert metrics_csv([]) == "iteration,iterations,time_s," + ",".join(vocab.PER_ITERATION) + "\n"


def test_the_toolbar_calls_the_dashboards_methods(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")
    save_run(run(10, stretch=0.005), tmp_path / "runs" / "older")
    engine = FakeEngine(iteration=12)
    run(12, rec=engine.telemetry)
    dash = LiveDashboard(engine, live=True, runs_dir=tmp_path / "runs", calibrate_after=None)
    dash.refresh(final=True)
    bar = dash.toolbar
    assert dash.widget.children[1] is bar.box, "status, controls, figure: one box"
    bar.panels["memory"].value = False
    bar.panels["loss"].value = False
    assert dash.view.hidden == {"memory", "loss"}
    bar.smoothing.value = 0.5
    bar.x_axis.value = "wall clock"
    assert (dash.view.smoothing, dash.view.x_axis) == (0.5, "wall clock")
    assert str(tmp_path / "runs" / "older") in bar.compare.options
    bar.compare.value = str(tmp_path / "runs" / "older")
    assert dash.comparison.labels() == ["older"] and "comparing: older" in bar.message.value
    bar.compare.value = BEFORE_AFTER  # no change yet: nothing to cut, said plainly
    assert dash.comparison.labels() == ["older", BEFORE_AFTER]
    bar.clear.click()
    assert dash.comparison.labels() == []
    bar.csv.click()
    encoded = bar.link.value.split("base64,", 1)[1].split("'", 1)[0]
    assert base64.b64decode(encoded).decode() == dash.csv_text()
    dash.set_view(hidden=())  # a change made in code shows in the controls
    assert all(b.value for b in bar.panels.values())


def test_the_save_button_keeps_the_run_and_the_compare_menu_lists_it_at_once(
        tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")
    engine = FakeEngine(iteration=12)
    run(12, rec=engine.telemetry)
    dash = LiveDashboard(engine, live=True, runs_dir=tmp_path / "runs", calibrate_after=None,
                         title="ratio 0.5")
    dash.refresh(final=True)
    bar = dash.toolbar
    assert list_runs(tmp_path / "runs") == []
    bar.save.click()
    (saved,) = list_runs(tmp_path / "runs")
    assert saved.name.startswith("ratio-0.5-") and str(saved) in bar.compare.options, \
        "in the menu at once, no other click needed"
    assert f"saved {saved}" in bar.message.value
    assert len(load_run(saved).metrics) == len(metrics.iteration_metrics(engine.telemetry.spans()))
    dash.save_run()  # from code too: a new folder, listed at once
    assert len([o for o in bar.compare.options if o.startswith(str(tmp_path))]) == 2
    save_run(run(5), tmp_path / "runs" / "elsewhere")  # saved by another notebook
    dash._runs_listed = -1e9  # the menu reads runs/ again on a refresh every RUNS_EVERY_S
    dash.refresh()
    assert str(tmp_path / "runs" / "elsewhere") in bar.compare.options
