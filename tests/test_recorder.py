"""Telemetry recorder: thread safety, bounds, snapshots."""

from __future__ import annotations

import threading

import pytest

from superoffload.telemetry.events import KIND_CPU_STEP, LANE_CPU, LANE_D2H, Span
from superoffload.telemetry.recorder import Recorder


def test_spans_from_many_threads_are_all_kept_in_sequence() -> None:
    rec = Recorder(max_events=10_000)

    def work(tid: int) -> None:
        for i in range(500):
            rec.add(LANE_CPU, KIND_CPU_STEP, float(i), float(i) + 0.5, iteration=tid, bucket=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = rec.spans()
    assert len(spans) == 4000
    assert rec.last_seq == 3999
    for tid in range(8):
        assert [s.bucket for s in spans if s.iteration == tid] == list(range(500))


def test_ring_buffer_is_bounded_and_spans_since_is_incremental() -> None:
    rec = Recorder(max_events=10)
    for i in range(25):
        rec.add(LANE_D2H, "d2h", i, i + 1, iteration=i, nbytes=4)
    assert [s.iteration for s in rec.spans()] == list(range(15, 25))
    new, last = rec.spans_since(21)
    assert [s.iteration for s in new] == [22, 23, 24]
    assert last == 24


def test_spans_since_reads_only_the_tail_and_matches_a_full_scan() -> None:
    rec = Recorder(max_events=100)
    for i in range(250):
        rec.add(LANE_D2H, "d2h", i, i + 1, iteration=i)
    held = [(q, s) for q, s in enumerate(range(250))][-100:]
    for seq in (-1, 0, 149, 150, 151, 200, 248, 249, 300):
        new, last = rec.spans_since(seq)
        assert [s.iteration for s in new] == [i for q, i in held if q > seq], seq
        assert last == 249
    assert Recorder().spans_since(-1) == ([], -1)


def test_disabled_recorder_records_nothing_but_keeps_notes() -> None:
    rec = Recorder(enabled=False)
    with rec.span(LANE_CPU, KIND_CPU_STEP, iteration=0):
        pass
    rec.scalar("loss", 0, 1.0)
    rec.note(0, "speculation off")
    assert rec.spans() == [] and rec.scalars() == []
    assert [n.text for n in rec.notes()] == ["speculation off"]


def test_unknown_lane_is_rejected() -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match="lane"):
        rec.record(Span("gpu", "x", 0.0, 1.0, 0))


def test_span_context_manager_times_the_body() -> None:
    rec = Recorder()
    with rec.span(LANE_CPU, KIND_CPU_STEP, iteration=3, bucket=1, nbytes=8):
        sum(range(10000))
    (span,) = rec.spans()
    assert span.iteration == 3 and span.bucket == 1 and span.nbytes == 8
    assert span.end_s >= span.start_s >= 0.0


def test_readers_that_keep_up_read_only_what_is_new() -> None:
    rec = Recorder(max_events=50)
    for i in range(80):
        rec.scalar("loss", i, float(i))
        rec.scalar("ratio", i, 0.5)
    got, seq = rec.scalars_since(-1)
    assert len(got) == 50 and got[0].iteration == 55, "the buffer's tail: the newest 50"
    rec.scalar("loss", 80, 80.0)
    new, seq2 = rec.scalars_since(seq)
    assert [(s.name, s.iteration) for s in new] == [("loss", 80)] and seq2 == seq + 1
    latest = rec.latest_scalar("ratio")
    assert latest is not None and latest.iteration == 79 and rec.latest_scalar("nope") is None
    for i in range(3):
        rec.note(i, f"note {i}")
    notes, count = rec.notes_since(1)
    assert [n.text for n in notes] == ["note 1", "note 2"] and count == 3
    assert rec.notes_since(count) == ([], 3)


def test_spans_from_an_iteration_stop_where_the_buffer_is_older() -> None:
    rec = Recorder()
    for it in range(40):
        for b in range(3):
            rec.add(LANE_D2H, "d2h", it, it + 0.5, iteration=it, bucket=b)
    rec.add(LANE_CPU, KIND_CPU_STEP, 5.0, 5.1, iteration=30)  # a late span of iteration 30
    got = rec.spans_from_iteration(30)
    assert sorted({s.iteration for s in got}) == list(range(30, 40)) and len(got) == 31
    assert got == [s for s in rec.spans() if s.iteration >= 30], "the order of the buffer"


def test_a_run_longer_than_the_buffer_keeps_its_start_binned() -> None:
    from superoffload.telemetry import metrics
    from superoffload.telemetry.window import WEIGHTS
    from tests.widgets_support import record_iteration

    full, capped = Recorder(), Recorder(max_events=300)  # ~24 iterations of spans
    t = 0.0
    for it in range(200):
        t2 = record_iteration(capped, it, t, loss=5.0 - 0.01 * it) + 0.001
        record_iteration(full, it, t, loss=5.0 - 0.01 * it)
        t = t2 + (0.02 if it == 7 else 0.0)  # iteration 7 stalls: its window is longer
    assert capped.spans()[0].iteration > 150, "the buffer holds only the newest iterations"
    archive, rest = capped.whole_run()
    ref = {m.iteration: m for m in metrics.iteration_metrics(full.spans())}
    rest_its = {m.iteration for m in metrics.iteration_metrics(rest)}
    assert archive.last_iteration + 1 == min(rest_its), "no iteration lost between the two"
    assert archive.iterations + len(rest_its) == 200
    # each archived bin is its iterations pooled, with their extremes (iteration 7 kept)
    ms = archive.series["iteration_ms"]
    assert ms.extreme("max") == (7, pytest.approx(ref[7].wall_s * 1e3))
    a = ms.arrays()
    for first, last, mean in zip(a["first"], a["last"], a["mean"]):
        its = [ref[i] for i in range(int(first), int(last) + 1)]
        w = [WEIGHTS["iteration_ms"](m) for m in its]
        want = sum(m.wall_s * 1e3 * x for m, x in zip(its, w)) / sum(w)
        assert mean == pytest.approx(want, rel=1e-9)
    assert "loss" not in archive.scalars or archive.scalars["loss"].first_iteration == 0
