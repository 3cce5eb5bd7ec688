"""OffloadTuner without a browser: move controls, assert the prediction shown and what apply
sends to the engine (a fake one, then the real engine on a tiny GPT). `debounce_s=0` runs
the planner inline, so a control change is followed at once; the debounced worker is tested
on its own."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import superoffload as so
from superoffload import plan
from superoffload.config import ConfigError, MiB
from superoffload.telemetry.abtest import latest_result
from superoffload.widgets.dashboard.dashboard import LiveDashboard
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared.debounce import Inline, LatestOnly
from superoffload.widgets.shared.runstate import RunState
from superoffload.widgets.tuner.core import (
    CONTROL_FIELDS,
    engine_changes,
    format_gb,
    predict,
    prediction_rows,
    reconfigurable_fields,
    setting_notes,
)
from superoffload.widgets.tuner.tuner import OffloadTuner
from tests.widgets_support import FakeEngine, FigureView

SHAPE = plan.ModelShape(layers=8, hidden=1024, heads=16, vocab=50257, seq=1024, micro_batch=2)


def simulated_s(config: so.OffloadConfig, profile: str = "gh200") -> float:
    res = plan.simulate(SHAPE, plan.profiles.get(profile), system="superoffload", config=config)
    return res.iteration_s


def test_the_prediction_shows_memory_against_one_ranks_share_of_the_host() -> None:
    from superoffload.plan.memory import HOST_HEADROOM
    from superoffload.plan.parallel import rank_profile

    whole = plan.profiles.get("h100-sxm")  # eight GPUs share the host: a rank has an eighth
    share = rank_profile(whole, SHAPE.ranks_per_host)
    assert share.host_memory_bytes < whole.host_memory_bytes  # the case is a real split
    pred = predict(SHAPE, whole, so.OffloadConfig())
    assert pred.host_capacity_bytes == pytest.approx(share.host_memory_bytes * HOST_HEADROOM)
    shown = {label: value for label, value, _ in prediction_rows(pred)}
    assert f"of {format_gb(share.host_memory_bytes * HOST_HEADROOM)} usable" in shown["host memory"]


def test_every_control_change_shows_the_planners_prediction() -> None:
    tuner = OffloadTuner(SHAPE, "gh200", debounce_s=0)
    assert isinstance(tuner.executor, Inline)
    first = tuner.prediction_html.value
    assert tuner.prediction.iteration_s == pytest.approx(simulated_s(tuner.config), rel=1e-12)
    tuner.controls["ratio"].value = 0.3  # what a slider move in the browser does
    assert tuner.values["ratio"] == 0.3 and tuner.config.ratio == 0.3
    assert tuner.prediction.iteration_s == pytest.approx(simulated_s(tuner.config), rel=1e-12)
    assert tuner.prediction_html.value != first
    for label, value, _ok in prediction_rows(tuner.prediction):  # a table, one row each
        table = tuner.prediction_html.value
        assert f">{label}</th>" in table and value.split(" ")[0] in table
    assert "ratio 0.30," in tuner.prediction_html.value
    tuner.controls["weights"].value = "flow"
    res = plan.simulate(SHAPE, plan.profiles.get("gh200"), config=tuner.config)
    assert tuner.prediction.device_bytes == res.memory["device"]
    assert tuner.prediction.host_bytes == res.memory["host"]


def test_set_moves_the_controls_and_extends_the_bucket_choices() -> None:
    tuner = OffloadTuner(SHAPE, "h100-pcie")  # debounced: set() still answers at once
    pred = tuner.set(ratio=0.55, bucket_bytes=3 * MiB, speculation="off", cpu_threads=4)
    assert tuner.controls["ratio"].value == 0.55
    assert tuner.controls["bucket_bytes"].value == 3 * MiB
    assert tuner.controls["bucket_bytes"].label == "3 MiB"
    assert tuner.controls["speculation"].value == "off"
    assert pred.iteration_s == pytest.approx(simulated_s(tuner.config, "h100-pcie"), rel=1e-12)
    assert pred.baseline_s == pytest.approx(
        plan.simulate(SHAPE, plan.profiles.get("h100-pcie"), system="zero-offload").iteration_s
    )


def test_bad_settings_are_refused_before_touching_the_controls() -> None:
    tuner = OffloadTuner(SHAPE, "gh200")
    with pytest.raises(ConfigError, match="ratio"):
        tuner.set(ratio=1.5)
    with pytest.raises(ValueError, match="unknown control"):
        tuner.set(lr=1.0)
    assert tuner.values["ratio"] == tuner.base_config.ratio
    with pytest.raises(ValueError, match="no engine attached"):
        tuner.apply()
    assert tuner.apply_button.disabled


def test_apply_sends_only_the_changed_reconfigurable_fields() -> None:
    engine = FakeEngine(iteration=12)
    engine.reconfigurable = frozenset({"ratio", "bucket_bytes"})  # what this engine takes live
    tuner = OffloadTuner(SHAPE, "gh200", engine=engine)
    assert tuner.values["ratio"] == engine.config.ratio
    assert tuner.apply_button.disabled, "nothing changed yet: nothing to apply"
    tuner.set(ratio=0.5, bucket_bytes=2 * MiB, weights="flow")
    assert not tuner.apply_button.disabled
    tuner.apply_button.click()  # the browser's click lands here
    assert engine.calls == [{"ratio": 0.5, "bucket_bytes": 2 * MiB}]
    assert ("applied ratio=0.5, bucket_bytes=2097152 at iteration 12 "
            "(in force from the next iteration)") in tuner.status_html.value
    assert "needs a restart: weights=flow" in tuner.status_html.value
    assert tuner.apply() == {}  # applied already: nothing new
    assert len(engine.calls) == 1 and tuner.apply_button.disabled


def test_apply_is_disabled_when_nothing_can_take_it_and_follows_the_run() -> None:
    assert OffloadTuner(SHAPE, "gh200").apply_blocked().startswith("no engine attached")
    data_parallel = FakeEngine()
    data_parallel.reconfigurable = frozenset()  # an engine that cannot reconfigure
    tuner = OffloadTuner(SHAPE, "gh200", engine=data_parallel)
    tuner.set(ratio=0.3)
    assert tuner.apply_button.disabled and "cannot reconfigure" in tuner.apply_blocked()
    closed = FakeEngine()
    closed.closed = True
    tuner = OffloadTuner(SHAPE, "gh200", engine=closed)
    tuner.set(ratio=0.3)
    assert tuner.apply_button.disabled and "closed" in tuner.status_html.value
    engine = FakeEngine(iteration=40)
    tuner = OffloadTuner(SHAPE, "gh200", engine=engine)
    tuner.set_run_state(RunState.RUNNING)
    assert "training running" in tuner.status_html.value
    tuner.set_run_state(RunState.FINISHED)
    tuner.set(ratio=0.3)
    tuner.apply()
    assert "training is not running" in tuner.status_line
    assert "in force from the next" not in tuner.status_line
    assert reconfigurable_fields(object()) == so.config.RECONFIGURABLE


def test_engine_changes_splits_live_and_restart_fields() -> None:
    cur = so.OffloadConfig()
    wanted = cur.replace(ratio=0.2, weights="flow")
    live, restart = engine_changes(cur, wanted, frozenset({"ratio"}))
    assert live == {"ratio": 0.2} and restart == {"weights": "flow"}


def test_flow_says_the_ratio_is_ignored_and_fields_come_from_the_config() -> None:
    assert set(CONTROL_FIELDS) == set(so.config.TUNED_FIELDS) and CONTROL_FIELDS[0] == "ratio"
    tuner = OffloadTuner(SHAPE, "gh200", debounce_s=0)
    tuner.controls["weights"].value = "flow"
    assert tuner.controls["ratio"].disabled and "ratio control is ignored" in tuner.notes_html.value
    assert setting_notes({"weights": "stationary", "ratio": 0.0}) == []


def test_does_not_fit_is_red_and_names_the_capacity() -> None:
    big = plan.ModelShape(layers=80, hidden=8192, heads=64, vocab=50257, seq=4096, micro_batch=8)
    tuner = OffloadTuner(big, "gh200", debounce_s=0, compare_baseline=False)
    tuner.set(ratio=0.0)
    assert tuner.prediction.fits is False
    table = tuner.prediction_html.value
    assert "DOES NOT FIT" in table and "color:#C00000" in table
    assert "usable" in tuner.prediction_html.value


def test_the_planner_runs_off_the_ui_thread_once_per_burst() -> None:
    runs: list[str] = []
    gate = LatestOnly(delay_s=0.05)
    futures = [gate.submit(lambda k=k: runs.append(threading.current_thread().name) or k)
               for k in range(20)]
    assert futures[-1].result(timeout=10) == 19
    assert all(f.cancelled() for f in futures[:-1]), "superseded values never run"
    assert runs == ["superoffload-debounce"]
    gate.close()
    tuner = OffloadTuner(SHAPE, "gh200", debounce_s=0.05)
    t0 = time.perf_counter()
    for k in range(6):  # six arrow-key presses
        tuner.controls["ratio"].value = 0.5 + 0.05 * (k + 1)
    assert time.perf_counter() - t0 < 0.5, "the control handler only queues the prediction"
    deadline = time.monotonic() + 10
    while tuner.prediction.iteration_s != pytest.approx(simulated_s(tuner.config), rel=1e-12):
        assert time.monotonic() < deadline, "the prediction follows the last value"
        time.sleep(0.02)
    assert "ratio 0.80," in tuner.prediction_html.value
    tuner.close()


def test_a_preview_dashboard_draws_the_simulated_timeline_of_each_setting() -> None:
    preview = LiveDashboard(None)
    tuner = OffloadTuner(SHAPE, "gh200", preview=preview)
    assert FigureView(preview.figure).layout.title.text.startswith("simulated")
    before = preview.simulation
    tuner.set(ratio=0.0)
    assert preview.simulation is not before
    assert preview.simulation.iteration_s == pytest.approx(tuner.prediction.iteration_s)
    assert preview.state.spans_seen > 0


def test_static_html_and_text_outside_a_notebook(tmp_path, capsys) -> None:
    tuner = OffloadTuner(SHAPE, "gh200")
    page = tuner.to_html(tmp_path / "tuner.html").read_text()
    assert "iteration time" in page and "plotly" in page
    tuner.display()
    out = capsys.readouterr().out
    assert "iteration time" in out and "not in a notebook" in out
    assert "profile gh200 (preset)" in out


def test_without_ipywidgets_the_tuner_still_predicts(monkeypatch, capsys) -> None:
    monkeypatch.setattr(_env, "has_module", lambda name: name != "ipywidgets")
    tuner = OffloadTuner(SHAPE, "gh200")
    assert tuner.widget is None and tuner.controls == {}
    pred = tuner.set(ratio=0.4)
    assert pred.iteration_s == pytest.approx(simulated_s(tuner.config), rel=1e-12)
    tuner.display()
    assert "ipywidgets missing" in capsys.readouterr().out


def test_apply_reconfigures_a_real_engine_on_a_later_iteration() -> None:
    from superoffload.data import BatchSampler, load_tokens
    from superoffload.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    config = so.presets.tiny_cpu().replace(bucket_bytes=64 * 1024, ratio=0.5)
    batches = BatchSampler(load_tokens()[:20000], batch_size=2, seq_len=16, seed=0)
    with so.initialize(model, optimizer={"lr": 1e-3}, config=config) as engine:
        tuner = OffloadTuner(model, engine=engine, micro_batch=2, compare_baseline=False)
        assert "measured on this machine" in tuner.choice.note

        def one_step() -> None:
            x, y = batches.next_batch()
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()

        one_step()
        tuner.set(ratio=1.0)
        assert tuner.apply(measure=False) == {"ratio": 1.0}
        assert engine.config.ratio == 0.5, "applied at the next iteration boundary, not now"
        applied_at = engine.iteration
        one_step()
        one_step()
        assert engine.config.ratio == 1.0
        ratios = {s.iteration: s.value for s in engine.telemetry.scalars("ratio")}
        assert ratios[applied_at - 1] == 0.5 and ratios[applied_at] == 1.0
        dash = LiveDashboard(engine)
        dash.refresh()
        assert f"ratio 1.00 (since it. {applied_at})" in dash.summary()
        assert dash.state.reconfigures[-1][0] == applied_at


def test_apply_measures_the_change_as_an_interleaved_ab() -> None:
    """Apply alternates old and new settings, reports the median change with
    its interval and verdict beside the predicted change, keeps it in the run's telemetry, and
    leaves the new settings in force."""
    from superoffload.data import BatchSampler, load_tokens
    from superoffload.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    config = so.presets.tiny_cpu().replace(bucket_bytes=64 * 1024, ratio=0.5)
    batches = BatchSampler(load_tokens()[:20000], batch_size=2, seq_len=16, seed=0)
    with so.initialize(model, optimizer={"lr": 1e-3}, config=config) as engine:
        tuner = OffloadTuner(model, engine=engine, micro_batch=2, compare_baseline=False,
                             ab_block=2, ab_pairs=5)
        tuner.set(ratio=1.0)
        assert [r.field for r in tuner.changes] == ["ratio"]  # change vs in force
        assert tuner.apply() == {"ratio": 1.0} and "measuring it as an A/B" in tuner.status_line
        ratios = []
        for _ in range(40):
            x, y = batches.next_batch()
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            ratios.append(engine.config.ratio)
        assert tuner.trial.done and len(tuner.ab_results) == 1
        res = tuner.ab_results[0]
        assert res.changes == {"ratio": (0.5, 1.0)} and res.pairs == 5 and res.block == 2
        assert res.ci[0] <= res.change <= res.ci[1] and res.predicted_change is not None
        assert tuner.status_line.startswith(f"measured: {res.line()}")
        assert 0.5 in ratios[:12] and 1.0 in ratios[:12] and ratios[-1] == 1.0
        notes = [(n.iteration, n.text) for n in engine.telemetry.notes()]
        assert latest_result(notes) == res.line()  # kept in the run's record
        # the run ends during a second trial: the new settings stay, the trial says why
        tuner.set(ratio=0.25)
        tuner.apply()
        tuner.set_run_state(RunState.STOPPED)
        assert tuner.trial.done and "stopped" in tuner.trial.error
        x, y = batches.next_batch()
        engine.backward(model(x, y))
        engine.step()
        assert engine.config.ratio == 0.25


def test_comparison_table_curve_and_calibration_are_shown() -> None:
    engine = FakeEngine(iteration=3)
    tuner = OffloadTuner(SHAPE, "gh200", engine=engine, debounce_s=0)
    assert tuner.changes == [] and "match the settings in force" in tuner.render_prediction(
        tuner.prediction, tuner.prediction_line)
    tuner.set(ratio=0.5, bucket_bytes=8 * MiB)
    rows = {r.field: r for r in tuner.changes}
    assert set(rows) == {"ratio", "bucket_bytes", "all"}
    only_ratio = simulated_s(engine.config.replace(ratio=0.5)) / simulated_s(engine.config) - 1
    assert rows["ratio"].change == pytest.approx(only_ratio)
    assert [r for r, _ in tuner.curve] == [i / 10 for i in range(11)]
    assert tuner.curve[5][1] == pytest.approx(simulated_s(tuner.config.replace(ratio=0.5)))
    page = tuner.render_prediction(tuner.prediction, tuner.prediction_line)
    assert "so-tuner-curve" in page and "over ratio 0-1 the predicted time moves" in page
    assert "predicted change vs in force" in page
    # gh200 is a preset: not calibrated, and the table says so
    assert tuner.prediction.calibrated is False
    assert ("calibrated", "no: expect it within 2x until the engine has run (docs/planner.md)",
            None) in prediction_rows(tuner.prediction)
    measured = OffloadTuner(SHAPE, "h200-pcie-measured", debounce_s=0)
    assert measured.prediction.calibrated is True  # its compute rate is fitted to a run
