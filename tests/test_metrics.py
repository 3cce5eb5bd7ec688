"""Telemetry metrics on a hand-made two-iteration timeline; every expected number is worked
out by hand in the comments (see the legend in superoffload/telemetry/metrics.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from superoffload.telemetry import intervals as I
from superoffload.telemetry import metrics as M
from superoffload.telemetry.events import Span

C, D2H, CPU, H2D, DOPT = "device_compute", "d2h", "cpu_optimizer", "h2d", "device_optimizer"


def timeline() -> list[Span]:
    return [
        # iteration 0: forward [0,1], backward [1,3]; two D2H (union [1.5,2.2] = 0.7 s, 2 GB);
        # CPU steps [2.0,2.8] + [2.8,3.6]; H2D [2.8,3.0] + [3.6,3.8] (0.4 s, 1 GB); GPU tail
        # step [3.0,3.2]
        Span(C, "forward", 0.0, 1.0, 0),
        Span(C, "backward", 1.0, 3.0, 0),
        Span(D2H, "d2h", 1.5, 2.0, 0, bucket=0, nbytes=1_000_000_000),
        Span(D2H, "d2h", 1.8, 2.2, 0, bucket=1, nbytes=1_000_000_000),
        Span(CPU, "cpu_step", 2.0, 2.8, 0, bucket=0),
        Span(CPU, "cpu_step", 2.8, 3.6, 0, bucket=1),
        Span(H2D, "h2d", 2.8, 3.0, 0, bucket=0, nbytes=500_000_000),
        Span(H2D, "h2d", 3.6, 3.8, 0, bucket=1, nbytes=500_000_000),
        Span(DOPT, "device_step", 3.0, 3.2, 0, bucket=2),
        # iteration 1: forward [3.2,4.2] blocked by a wait [3.5,3.8] (bucket 1's H2D);
        # backward [4.2,6.2]; CPU [6.2,7.0] with a rollback and a replay inside; H2D [7.0,7.5]
        Span(C, "forward", 3.2, 4.2, 1),
        Span(C, "wait", 3.5, 3.8, 1, bucket=1),
        Span(C, "backward", 4.2, 6.2, 1),
        Span(CPU, "cpu_step", 6.2, 7.0, 1, bucket=0),
        Span(CPU, "rollback", 6.6, 6.7, 1, bucket=0),
        Span(CPU, "replay", 6.7, 6.9, 1, bucket=0),
        Span(H2D, "h2d", 7.0, 7.5, 1, bucket=0, nbytes=1_000_000_000),
    ]


def test_interval_helpers_by_hand() -> None:
    assert I.union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert I.length([(0, 1), (0.5, 2)]) == 2
    assert I.intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert I.subtract([(0, 5)], [(1, 2), (3, 4)]) == [(0, 1), (2, 3), (4, 5)]
    assert I.subtract([(0, 1)], [(-1, 2)]) == []
    assert I.clip([(0, 10)], (2, 3)) == [(2, 3)]


intervals = st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 50)).map(lambda t: (float(min(t)), float(max(t)))),
    max_size=8,
)


@given(intervals, intervals)
def test_interval_algebra_partitions(a: list[I.Interval], b: list[I.Interval]) -> None:
    # |A| = |A ∩ B| + |A \ B|, and both results are disjoint and sorted
    assert I.length(a) == pytest.approx(I.length(I.intersect(a, b)) + I.length(I.subtract(a, b)))
    for parts in (I.intersect(a, b), I.subtract(a, b), I.union(a)):
        assert all(x[1] < y[0] or x[1] == y[0] for x, y in zip(parts, parts[1:]))
    # brute force on the integer grid: a unit cell [k, k+1] is in A iff some interval covers it
    cells = sum(1 for k in range(50) if any(s <= k and k + 1 <= e for s, e in a))
    assert I.length(a) == cells


def test_iteration_metrics_by_hand() -> None:
    m0, m1 = M.iteration_metrics(timeline())
    # iteration 0: window [0, 3.2] (next forward starts at 3.2)
    assert m0.iteration == 0 and m0.start_s == 0.0
    assert m0.wall_s == pytest.approx(3.2)
    # device busy [0,3.2] inside the window (forward, backward, GPU tail step)
    assert m0.compute_s == pytest.approx(3.2)
    assert m0.device_idle_frac == pytest.approx(0.0)
    # CPU lane [2.0,3.6] clipped to the window: 1.2 s of 3.2
    assert m0.cpu_busy_s == pytest.approx(1.2)
    assert m0.cpu_busy_frac == pytest.approx(0.375)
    # own CPU work 1.6 s; device busy during [2.0,3.5] -> 1.5 / 1.6
    assert m0.cpu_step_s == pytest.approx(1.6)
    assert m0.cpu_overlap_frac == pytest.approx(0.9375)
    # tail [3.0 backward end, 3.8 last H2D end] = 0.8 s, model compute inside: [3.2,3.5]
    # -> exposed 0.5 s (the 0.2 s GPU tail step plus the 0.3 s wait)
    assert m0.exposed_optimizer_s == pytest.approx(0.5)
    assert m0.d2h_bytes == 2_000_000_000 and m0.h2d_bytes == 1_000_000_000
    assert m0.d2h_gbps_busy == pytest.approx(2.0 / 0.7)
    assert m0.d2h_gbps_wall == pytest.approx(2.0 / 3.2)
    assert m0.h2d_gbps_busy == pytest.approx(1.0 / 0.4)
    assert m0.h2d_gbps_wall == pytest.approx(1.0 / 3.2)
    assert (m0.rollbacks, m0.replays) == (0, 0)

    # iteration 1 (last): window [3.2, 7.5]; device busy [3.2,3.5] + [3.8,6.2] = 2.7 s
    assert m1.wall_s == pytest.approx(4.3)
    assert m1.compute_s == pytest.approx(2.7)
    assert m1.device_idle_frac == pytest.approx(1 - 2.7 / 4.3)
    # CPU lane in the window: [3.2,3.6] (iteration 0's tail) + [6.2,7.0] = 1.2 s
    assert m1.cpu_busy_s == pytest.approx(1.2)
    # its own CPU work [6.2,7.0] ran while the device was idle
    assert m1.cpu_step_s == pytest.approx(0.8)
    assert m1.cpu_overlap_frac == pytest.approx(0.0)
    # nothing overlaps the tail [6.2, 7.5]: all 1.3 s exposed (a ZeRO-Offload-like step)
    assert m1.exposed_optimizer_s == pytest.approx(1.3)
    assert m1.h2d_gbps_busy == pytest.approx(2.0)
    assert (m1.rollbacks, m1.replays) == (1, 1)


def test_summary_pools_the_window_and_totals_the_run() -> None:
    s = M.summarize(timeline())
    assert s.iterations == 2 and s.window_label() == "iterations 0-1"
    assert s.wall_s == pytest.approx((3.2 + 4.3) / 2)
    assert s.exposed_optimizer_s == pytest.approx((0.5 + 1.3) / 2)
    # pooled: iteration 0 hid 1.5 s of its 1.6 s CPU step, iteration 1 none of its 0.8 s
    # (the median of the two shares, 0.47, was the number this replaced)
    assert s.cpu_overlap_frac == pytest.approx(1.5 / 2.4)
    assert s.device_idle_frac == pytest.approx(1 - (3.2 + 2.7) / 7.5)  # device busy / wall
    assert s.h2d_gbps_busy == pytest.approx(2.0 / 0.9)  # 2 GB in 0.4 s + 0.5 s of moving
    assert s.h2d_bytes_total == 2_000_000_000
    assert (s.rollbacks_total, s.replays_total) == (1, 1)
    skipped = M.summarize(timeline(), skip=1)
    assert skipped.iterations_in_window == 1 and skipped.wall_s == pytest.approx(4.3)
    assert skipped.window_label() == "iteration 1"
    # totals still count the skipped warm-up iteration
    assert skipped.iterations == 2 and skipped.h2d_bytes_total == 2_000_000_000
    with pytest.raises(ValueError, match="skip"):
        M.summarize(timeline(), skip=-1)


def test_iteration_without_cpu_work_counts_as_fully_overlapped() -> None:
    spans = [Span(C, "forward", 0.0, 1.0, 0), Span(C, "backward", 1.0, 2.0, 0)]
    (m,) = M.iteration_metrics(spans)
    assert m.cpu_overlap_frac == 1.0 and m.exposed_optimizer_s == 0.0 and m.d2h_gbps_busy == 0.0


def test_bandwidth_series_spreads_bytes_over_time() -> None:
    spans = [Span(C, "forward", 0.0, 4.0, 0), Span(H2D, "h2d", 1.0, 3.0, 0, nbytes=4_000_000_000)]
    times, gbps = M.bandwidth_series(spans, "h2d", bin_s=1.0)
    assert times == [0.0, 1.0, 2.0, 3.0]
    assert gbps == pytest.approx([0.0, 2.0, 2.0, 0.0])
    # the series conserves bytes
    assert sum(g * 1.0 for g in gbps) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="bin_s"):
        M.bandwidth_series(spans, "h2d", bin_s=-1.0)


def test_records_are_plain_dicts_and_dataframe_is_optional() -> None:
    records = M.to_records(timeline())
    assert [r["iteration"] for r in records] == [0, 1]
    assert records[0]["wall_s"] == pytest.approx(3.2)
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pandas"):
            M.to_dataframe(timeline())
    else:
        df = M.to_dataframe(timeline())
        assert list(df["iteration"]) == [0, 1]


@given(intervals, st.tuples(st.integers(0, 50), st.integers(0, 50)))
def test_indexed_window_queries_match_the_plain_algebra(a: list[I.Interval],
                                                        w: tuple[int, int]) -> None:
    # iteration_metrics clips the whole timeline once per iteration through a bisect index
    window = (float(min(w)), float(max(w)))
    index = I.Disjoint(a)
    assert index.clip(window) == I.clip(a, window)
    assert index.overlap(a[:3]) == pytest.approx(I.length(I.intersect(a, a[:3])))


@given(intervals, st.tuples(st.integers(0, 50), st.integers(0, 50)))
def test_window_lengths_match_the_plain_algebra(a: list[I.Interval], w: tuple[int, int]) -> None:
    # length_in answers from a prefix sum without visiting the intervals: same number
    window = (float(min(w)), float(max(w)))
    assert I.Disjoint(a).length_in(window) == pytest.approx(I.length(I.clip(a, window)))


@given(intervals, intervals)
def test_subtract_keeps_exactly_the_points_outside_b(a: list[I.Interval],
                                                     b: list[I.Interval]) -> None:
    # checked point by point on the half-integer grid (the endpoints are integers)
    out = I.subtract(a, b)
    assert out == I.union(out), "sorted and disjoint"
    for k in range(101):
        x = k / 2
        in_a = any(s <= x < e for s, e in a)
        in_b = any(s <= x < e for s, e in b)
        assert any(s <= x < e for s, e in out) == (in_a and not in_b), x
