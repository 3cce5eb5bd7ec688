"""One metric, one number: on one real run of the engine, the CLI's progress bar and summary,
the Trainer/Lightning log (`integrations.bridge.EngineMetrics`) and the dashboard's status
line each name a window of iterations, and each shows exactly `telemetry.window.window_values`
of the iterations it names (pooled: totals over totals). Before, the log averaged shares, the
progress bar averaged the last three, the summary and the dashboard took medians, and a
bimodal share (0 % or 100 % per iteration) read 80 %, 100 % and 61 % at once."""

from __future__ import annotations

import argparse
import math
import re

import pytest
import torch

import superoffload as so
from superoffload.commands.train_output import SUMMARY_METRICS, print_summary, progress_postfix
from superoffload.data import BatchSampler, load_tokens
from superoffload.integrations.bridge import METRIC_PREFIX, EngineMetrics
from superoffload.models import GPT, gpt_tiny
from superoffload.telemetry import metrics
from superoffload.telemetry.vocabulary import METRICS, summary_values
from superoffload.telemetry.window import window_values
from superoffload.train_loop import StepInfo, TrainSettings, train
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import Workload, status_lines
from superoffload.widgets.shared.runstate import RunState

STEPS = 30


@pytest.fixture(scope="module")
def one_run() -> dict:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    cfg = so.OffloadConfig(device="cpu", bucket_bytes=32 * 1024, ratio=0.5, speculation="on")
    seen: list[StepInfo] = []
    sampler = BatchSampler(load_tokens()[:200_000], batch_size=2, seq_len=16, seed=0)
    with so.initialize(model, optimizer={"lr": 1e-3, "weight_decay": 0.0}, config=cfg) as engine:
        logged = EngineMetrics(engine)  # what the Trainer / Lightning integrations log
        result = train(engine, model, sampler, TrainSettings(steps=STEPS, metrics_every=1,
                                                             eval_batches=0), on_step=seen.append)
        log = logged.collect()
    return {"result": result, "steps": seen, "log": log,
            "metrics": metrics.iteration_metrics(result.spans)}


def between(ms: list[metrics.IterationMetrics], first: int, last: int) -> dict[str, float]:
    return window_values([m for m in ms if first <= m.iteration <= last])


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9)


def test_the_cli_progress_bar_shows_its_window_pooled(one_run: dict) -> None:
    info = one_run["steps"][-1]
    w = info.window
    assert w is not None and w.iterations == 20, "the last 20 complete iterations"
    want = between(one_run["metrics"], w.first, w.last)
    assert same(100 * info.overlap, want["cpu_step_hidden_pct"])
    text = progress_postfix(info)
    assert text.endswith(f"{METRICS['cpu_step_hidden_pct'].show(want['cpu_step_hidden_pct'])} "
                         f"(it. {w.first}-{w.last})"), text


def test_the_cli_summary_pools_the_run_after_its_warm_up(one_run: dict, capsys) -> None:
    result = one_run["result"]
    ms = one_run["metrics"]
    payload = {**result.to_dict(), "start_step": 0, "engine_stats": {
        "clipped_steps": 0, "rollbacks": 0, "replays": 0, "skipped_steps": 0}}
    print_summary(payload, argparse.Namespace(sample_temperature=0.0, sample_top_k=0))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("per iteration"))
    assert line.startswith(f"per iteration, iterations 1-{ms[-1].iteration} pooled: "), line
    want = window_values(ms[1:])
    shown = summary_values(result.summary)
    for name in SUMMARY_METRICS:
        assert same(shown[name], want[name]), name
        if not math.isnan(want[name]):
            assert METRICS[name].show(want[name]) in line, name


def test_the_trainer_and_lightning_log_pools_the_iterations_since_the_last_log(
        one_run: dict) -> None:
    log, ms = one_run["log"], one_run["metrics"]
    n = int(log[METRIC_PREFIX + "window_iterations"])
    assert n == len(ms) - 1, "every complete iteration (the newest one is still in flight)"
    want = window_values(ms[:n])
    for key, value in log.items():
        name = key.removeprefix(METRIC_PREFIX)
        if name in want and name not in ("rollbacks", "replays"):  # logs carry run totals
            assert same(value, want[name]), name
    assert same(log[METRIC_PREFIX + "d2h_gbps_busy"], want["d2h_gbps_busy"])


def test_the_dashboard_status_names_its_window_and_pools_it(one_run: dict) -> None:
    ms = one_run["metrics"]
    state = DashboardState()
    state.add_spans(one_run["result"].spans, final=True)
    lines = status_lines(state, Workload(), [], run_state=RunState.FINISHED, iteration=STEPS)
    found = re.match(r"iterations (\d+)-(\d+), pooled: (.*)", lines[1])
    assert found, lines[1]
    first, last = int(found.group(1)), int(found.group(2))
    assert (first, last) == (ms[-20].iteration, ms[-1].iteration)
    want = between(ms, first, last)
    for name in ("iteration_ms", "d2h_gbps_busy", "cpu_step_hidden_pct", "device_idle_pct"):
        assert METRICS[name].show(want[name]) in found.group(3), name


def test_views_agree_where_their_windows_meet(one_run: dict) -> None:
    # the progress bar's window, asked of the dashboard's state: one definition, one number
    info = one_run["steps"][-1]
    ms = one_run["metrics"]
    state = DashboardState()
    state.add_spans(one_run["result"].spans, final=True)
    inside = [p.metrics for p in state.recent_by_rank[0]
              if info.window.first <= p.iteration <= info.window.last]
    dash = window_values([m for m in inside if m is not None])
    assert same(dash["cpu_step_hidden_pct"], 100 * info.overlap)
    assert any(m.cpu_step_s > 0 for m in ms), "the run stepped buckets on the CPU"
