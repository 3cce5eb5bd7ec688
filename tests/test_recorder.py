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
