"""Chrome / Perfetto trace export: the file is valid Trace Event Format JSON with one track
per lane and flow arrows D2H -> CPU step -> H2D per bucket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import superoffload as so
from superoffload import plan
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.telemetry import Span
from superoffload.telemetry.recorder import Recorder
from superoffload.telemetry.trace import (
    FLOW_CAT,
    assign_tracks,
    check_chrome_trace,
    chrome_trace,
    prepare_chrome_trace,
    sample_iterations,
    write_chrome_trace,
)
from tests.widgets_support import filled_recorder

LANE_THREADS = {"device compute", "D2H (grads out)", "CPU optimizer", "H2D (weights in)",
                "device optimizer"}


def load(path: Path) -> dict:
    data = json.loads(path.read_text())  # valid JSON, object form
    assert check_chrome_trace(data) == []
    return data


def thread_names(data: dict, pid: int = 0) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def flows(data: dict) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "f"):
            assert e["cat"] == FLOW_CAT and e["bp"] == "e"
            out.setdefault(e["id"], {})[e["ph"]] = e
    return out


def slice_at(data: dict, pid: int, tid: int, ts: float) -> dict:
    (hit,) = [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
              and e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]
    return hit


def test_recorder_trace_has_lanes_flows_counters_and_notes(tmp_path: Path) -> None:
    rec = filled_recorder(3, buckets=2, loss=4.0, ratio=0.5)
    rec.note(1, "reconfigure applied: ratio 0.5 -> 0.8")
    data = load(write_chrome_trace(rec, tmp_path / "sub" / "trace.json"))
    assert data["displayTimeUnit"] == "ms"
    names = thread_names(data)
    assert set(names.values()) >= LANE_THREADS and names[0] == "iterations"
    # 3 iterations x 2 buckets, each backward -> D2H -> CPU step -> H2D: three arrows per bucket
    pairs = flows(data)
    assert len(pairs) == 3 * 2 * 3
    kinds = []
    for pair in pairs.values():
        src = slice_at(data, 0, pair["s"]["tid"], pair["s"]["ts"])
        dst = slice_at(data, 0, pair["f"]["tid"], pair["f"]["ts"])
        assert src["args"]["iteration"] == dst["args"]["iteration"]
        if src["name"] == "backward":  # where the bucket's gradients were complete
            assert pair["s"]["ts"] == pytest.approx(dst["ts"]), "at the copy's start"
        else:
            assert src["args"]["bucket"] == dst["args"]["bucket"]
        assert pair["s"]["ts"] <= pair["f"]["ts"], "arrows point forward in time"
        kinds.append((names[pair["s"]["tid"]], names[pair["f"]["tid"]]))
    assert set(kinds) == {("device compute", "D2H (grads out)"),
                          ("D2H (grads out)", "CPU optimizer"),
                          ("CPU optimizer", "H2D (weights in)")}
    # counters and args in the metric vocabulary: names, units (ms, not s) and titles
    counters = {e["name"]: e["args"] for e in data["traceEvents"] if e["ph"] == "C"}
    titles = {"loss (nats)", "ratio", "D2H while moving (GB/s)", "CPU step hidden (%)"}
    assert titles <= set(counters)
    assert set(counters["D2H while moving (GB/s)"]) == {"d2h_gbps_busy"}
    (note,) = [e for e in data["traceEvents"] if e["ph"] == "i"]
    assert note["name"].startswith("reconfigure applied") and note["s"] == "g"
    its = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "iteration"]
    assert [e["name"] for e in its] == ["iteration 0", "iteration 1", "iteration 2"]
    assert its[0]["args"]["iteration_ms"] == pytest.approx(its[0]["dur"] / 1e3), "ms, as on screen"
    d2h = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "d2h"]
    assert d2h[0]["ts"] == pytest.approx(12_000) and d2h[0]["dur"] == pytest.approx(2_000)  # us


def test_several_ranks_get_one_process_each(tmp_path: Path) -> None:
    spans = [Span("device_compute", "backward", 0.0, 0.01, 0, rank=r) for r in (0, 1)]
    spans += [Span("d2h", "d2h", 0.002, 0.004, 0, bucket=0, nbytes=10, rank=r) for r in (0, 1)]
    spans += [Span("cpu_optimizer", "cpu_step", 0.004, 0.006, 0, bucket=0, rank=r) for r in (0, 1)]
    data = load(write_chrome_trace(spans, tmp_path / "t.json"))
    procs = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "superoffload rank 0", 1: "superoffload rank 1"}
    pairs = flows(data)
    assert len(pairs) == 4 and {p["s"]["pid"] for p in pairs.values()} == {0, 1}


def test_partially_overlapping_spans_spill_onto_a_second_track() -> None:
    a = Span("cpu_optimizer", "cpu_step", 0.0, 2.0, 0, bucket=0)
    nested = Span("cpu_optimizer", "rollback", 0.5, 1.0, 0, bucket=0)
    crossing = Span("cpu_optimizer", "cpu_step", 1.5, 3.0, 0, bucket=1)
    after = Span("cpu_optimizer", "cpu_step", 3.0, 4.0, 0, bucket=2)
    tracks = assign_tracks([crossing, after, nested, a])
    assert tracks == [[a, nested, after], [crossing]]
    data = chrome_trace([a, nested, crossing, after])
    assert check_chrome_trace(data) == []
    names = set(thread_names(data).values())
    assert {"CPU optimizer", "CPU optimizer (2)"} <= names


def test_a_real_engine_run_exports_a_loadable_trace(tmp_path: Path, one_thread: None) -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    engine = so.initialize(model, optimizer={"lr": 1e-3},
                           config=so.presets.tiny_cpu().replace(bucket_bytes=32 * 1024))
    try:
        x = torch.randint(0, 256, (2, 16))
        for _ in range(3):
            engine.backward(model(x, x))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        data = load(write_chrome_trace(engine.telemetry, tmp_path / "engine.json"))
    finally:
        engine.close()
    names = set(thread_names(data).values())
    assert {"device compute", "D2H (grads out)", "CPU optimizer", "H2D (weights in)"} <= names
    host_buckets = len(engine.bucket_plan.host_buckets)
    assert len(flows(data)) >= 3 * host_buckets * 3 - 3 * host_buckets  # late last iteration
    from_backward = [p for p in flows(data).values()
                     if thread_names(data)[p["s"]["tid"]] == "device compute"]
    assert len(from_backward) == host_buckets * 3, "one backward -> D2H arrow per bucket"


def test_a_simulated_timeline_exports_too(tmp_path: Path) -> None:
    shape = plan.ModelShape(layers=4, hidden=256, heads=4, vocab=1000, seq=128, micro_batch=1)
    res = plan.simulate(shape, plan.profiles.get("gh200"))
    data = load(write_chrome_trace(res.timeline, tmp_path / "sim.json"))
    assert flows(data)


def test_a_long_run_can_be_sampled_and_says_its_size_before_writing(tmp_path: Path) -> None:
    rec = filled_recorder(40, buckets=2, loss=4.0)
    full = prepare_chrome_trace(rec)
    tenth = prepare_chrome_trace(rec, every=10)
    recent = prepare_chrome_trace(rec, last=5)
    assert (full.iterations, tenth.iterations, recent.iterations) == (40, 4, 5)
    assert tenth.describe().startswith("trace of 4 of 40 iterations (every 10th iteration): ")
    assert 0.05 < tenth.nbytes / full.nbytes < 0.2, "the size follows the iterations kept"
    data = load(tenth.write(tmp_path / "t.json"))
    kept = sorted({e["args"]["iteration"] for e in data["traceEvents"] if e["ph"] == "X"
                   and e["cat"] != "iteration"})
    assert kept == [0, 10, 20, 30]
    assert sample_iterations(range(100), every=3, last=10) == {90, 93, 96, 99}
    with pytest.raises(ValueError, match="every=0"):
        prepare_chrome_trace(rec, every=0)
    with pytest.raises(ValueError, match="last=0"):
        write_chrome_trace(rec, tmp_path / "x.json", last=0)


def test_bad_sources_say_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Recorder or a sequence of Span"):
        write_chrome_trace("spans.jsonl", tmp_path / "x.json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="telemetry Span"):
        write_chrome_trace([1], tmp_path / "x.json")  # type: ignore[list-item]
    assert check_chrome_trace({"events": []}) != []
    bad = {"traceEvents": [{"ph": "X", "pid": 0, "tid": 1, "name": "a", "ts": 0, "dur": -1},
                           {"ph": "s", "pid": 0, "tid": 1, "name": "f", "id": 1, "cat": "c",
                            "ts": 5}]}
    problems = check_chrome_trace(bad)
    assert any("dur" in p for p in problems) and any("one 's' and one 'f'" in p for p in problems)
    assert check_chrome_trace(chrome_trace([], scalars=(), notes=())) == []
    assert Recorder  # the public source type
