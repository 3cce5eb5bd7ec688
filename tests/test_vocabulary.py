"""One vocabulary of metrics: the CLI, the dashboard, the report, the
Trainer/Lightning logs, TensorBoard and the trace name, scale and define every figure from
`telemetry.vocabulary.METRICS`; each view's names are checked against that one table here."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

import pytest

from superoffload.commands.train_output import SUMMARY_METRICS, print_summary
from superoffload.integrations.bridge import METRIC_PREFIX, EngineMetrics
from superoffload.telemetry import metrics
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.tensorboard import scalar_rows
from superoffload.telemetry.trace import chrome_trace
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.expected import Expected
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import Workload, status_lines
from superoffload.widgets.dashboard.traces import SPECS
from superoffload.widgets.shared.runstate import RunState
from tests.widgets_support import filled_recorder, record_iteration

NAMES = set(vocab.METRICS)
LABELS = {m.label for m in vocab.METRICS.values()}


def test_the_table_is_well_formed() -> None:
    for name, m in vocab.METRICS.items():
        assert m.name == name and m.label and m.group and len(m.definition) > 20, name
        assert m.unit in ("", "ms", "GB/s", "%", "tokens/s", "TFLOP/s", "GB", "nats", "count"), m
    assert len(LABELS) == len(NAMES), "one label, one meaning"
    # one unit per quantity: times in ms, rates in GB/s, shares in %
    assert {vocab.METRICS[n].unit for n in NAMES if n.endswith("_ms")} == {"ms"}
    assert {vocab.METRICS[n].unit for n in NAMES if "gbps" in n} == {"GB/s"}
    assert {vocab.METRICS[n].unit for n in NAMES if n.endswith("_pct")} == {"%"}
    assert set(vocab.PER_ITERATION) <= NAMES
    assert {to for to, _ in vocab.ENGINE_SCALARS.values()} <= NAMES
    assert vocab.engine_scalar("iteration_s", 0.25) == ("iteration_ms", 250.0)
    with pytest.raises(ValueError, match="unknown metric 'link_gbps'"):
        vocab.metric("link_gbps")


def test_per_iteration_values_are_the_metrics_in_their_units() -> None:
    m = metrics.iteration_metrics(filled_recorder(3).spans())[1]
    v = vocab.iteration_values(m)
    assert set(v) == set(vocab.PER_ITERATION)
    assert v["iteration_ms"] == pytest.approx(m.wall_s * 1e3)
    assert v["engine_ms"] + v["outside_engine_ms"] == pytest.approx(v["iteration_ms"])
    assert (v["d2h_gbps_busy"] == m.d2h_gbps_busy
            and v["cpu_step_hidden_pct"] == 100 * m.cpu_overlap_frac)
    assert vocab.METRICS["d2h_gbps_busy"].show(0.331) == "D2H while moving 0.331 GB/s"
    assert vocab.METRICS["tokens_per_s"].show(2290.0) == "2.29k tokens/s"


def test_the_dashboard_names_its_lines_axes_and_status_from_the_table() -> None:
    for spec in SPECS:
        if spec.kind in ("line", "dash", "band", "peak"):
            assert spec.metric in NAMES, spec.key
            unit = vocab.METRICS[spec.metric].unit
            y_title = L.MEASURED[spec.panel].y_title
            assert y_title.split(" ")[0] == unit, (spec.key, y_title, unit)
    state = DashboardState()
    state.add_spans(filled_recorder(8, loss=3.0).spans(), final=True)
    work = Workload(tokens_per_iteration=512, flops_per_iteration=1e9, d2h_peak_gbps=40.0,
                    h2d_peak_gbps=40.0, profile_name="p")
    lines = status_lines(state, work, [Expected(0, 0.030, 0.1)], run_state=RunState.RUNNING,
                         iteration=8)
    key = lines[1].split(", pooled: ", 1)[1]
    for piece in key.split(" · "):
        head = re.sub(r" [-\d.]+[kMG]? ?\S*( \(.*\))?$", "", piece)
        assert head in LABELS or piece.endswith("tokens/s") or piece.endswith("TFLOP/s"), piece


def test_the_cli_summary_speaks_the_same_words(capsys) -> None:
    spans = filled_recorder(6).spans()
    summary = metrics.summarize(spans, skip=1)
    result = {"first_loss": 5.0, "final_loss": 3.0, "tokens_per_s": 2290.0, "steps": 6,
              "start_step": 0, "elapsed_s": 1.0, "summary": summary.to_dict(),
              "engine_stats": {"clipped_steps": 0, "rollbacks": 0, "replays": 0,
                               "skipped_steps": 0}}
    print_summary(result, argparse.Namespace(sample_temperature=0.0, sample_top_k=0))
    out = capsys.readouterr().out
    assert "2.29k tokens/s over 6 steps" in out
    line = next(x for x in out.splitlines() if x.startswith("per iteration, "))
    assert line == "per iteration, iterations 1-5 pooled: " + vocab.describe_values(
        vocab.summary_values(summary), SUMMARY_METRICS)
    assert all(vocab.METRICS[n].label in line for n in SUMMARY_METRICS)


def test_trainer_and_lightning_logs_use_the_table() -> None:
    rec = filled_recorder(1)
    engine = SimpleNamespace(telemetry=rec, iteration=1,
                             stats=SimpleNamespace(rollbacks=2, replays=1, clipped_steps=3,
                                                   skipped_steps=0))
    logged = EngineMetrics(engine)
    t = 0.034
    for it in range(1, 6):
        engine.iteration = it
        logged.add_tokens(256)
        logged.add_tokens(256)  # two micro-batches per optimizer step
        t = record_iteration(rec, it, t) + 0.001
    rec.scalar("grad_norm", 5, 1.5)
    out = logged.collect()
    assert {k.removeprefix(METRIC_PREFIX) for k in out} <= NAMES
    assert all(k.startswith(METRIC_PREFIX) for k in out)
    m = {x.iteration: x for x in metrics.iteration_metrics(rec.spans())}
    done = [m[i] for i in range(1, 5)]  # 5 is not complete yet
    wall = sum(x.wall_s for x in done)
    assert out[METRIC_PREFIX + "iteration_ms"] == pytest.approx(1e3 * wall / 4)
    assert out[METRIC_PREFIX + "tokens_per_s"] == pytest.approx(4 * 512 / wall), \
        "tokens of those iterations"
    assert out[METRIC_PREFIX + "d2h_gbps_busy"] == pytest.approx(
        sum(x.d2h_bytes for x in done) / sum(x.d2h_busy_s for x in done) / 1e9)
    assert out[METRIC_PREFIX + "cpu_step_hidden_pct"] == pytest.approx(100.0)
    assert out[METRIC_PREFIX + "grad_norm"] == 1.5 and out[METRIC_PREFIX + "rollbacks"] == 2.0


def test_tensorboard_and_the_trace_use_the_table() -> None:
    rec = filled_recorder(4, loss=3.0, ratio=0.5)
    rec.scalar("iteration_s", 2, 0.034)
    assert {tag for tag, _, _ in scalar_rows(rec, tokens_per_iteration=64, link_peak_gbps=10.0)} \
        <= {m.tag for m in vocab.METRICS.values()}
    trace = chrome_trace(rec.spans(), scalars=rec.scalars())
    titles = {m.title for m in vocab.METRICS.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            assert e["name"] in titles and set(e["args"]) <= NAMES, e
        if e["ph"] == "X" and e.get("cat") == "iteration":
            assert set(e["args"]) <= NAMES, e["args"]
    (it_ms,) = [e for e in trace["traceEvents"]
                if e["ph"] == "C" and e["name"] == "iteration time (ms)"]
    assert it_ms["args"] == {"iteration_ms": pytest.approx(34.0)}, "ms in the trace, as on screen"
