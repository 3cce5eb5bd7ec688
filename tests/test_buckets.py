"""The bucket planner is pure: checked on hand-made sizes and by property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superoffload.plan.buckets import ParamSpec, plan_buckets


def specs(sizes, trainable=None):
    trainable = trainable or [True] * len(sizes)
    return [ParamSpec(i, n, t, f"p{i}") for i, (n, t) in enumerate(zip(sizes, trainable))]


def test_gradient_ready_order_and_sizes():
    # 4 B/param: 1000 params = 4000 B; a bucket holds at most 8192 B.
    plan = plan_buckets(specs([1000, 1000, 1000, 3000]), bucket_bytes=8192, ratio=1.0)
    assert [b.param_indices for b in plan.buckets] == [(3,), (2, 1), (0,)]
    assert [b.nbytes for b in plan.buckets] == [12000, 8000, 4000]
    assert all(not b.on_device for b in plan.buckets)


@pytest.mark.parametrize(
    ("ratio", "n_host"), [(0.0, 0), (1.0, 4), (0.5, 2), (0.74, 3), (0.9, 4), (0.1, 0)]
)
def test_ratio_keeps_last_buckets_on_device(ratio, n_host):
    plan = plan_buckets(specs([1024] * 4), bucket_bytes=4096, ratio=ratio)
    assert len(plan.buckets) == 4
    assert [b.on_device for b in plan.buckets] == [False] * n_host + [True] * (4 - n_host)
    # the device tail is the buckets produced last in backward = the first layers
    if n_host < 4:
        assert 0 in plan.buckets[-1].param_indices


def test_frozen_skipped_and_shared_counted_once():
    params = specs([10, 20, 30], trainable=[True, False, True])
    shared = [*params, ParamSpec(0, 10, True, "p0")]  # p0 used again at the end (tied head)
    plan = plan_buckets(shared, bucket_bytes=4096, ratio=1.0)
    members = [i for b in plan.buckets for i in b.param_indices]
    assert members == [2, 0]  # frozen p1 absent; tied p0 once, final after its first use
    assert plan.total_numel == 40


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs([1]), bucket_bytes=0, ratio=0.5)
    with pytest.raises(ValueError, match="ratio"):
        plan_buckets(specs([1]), bucket_bytes=4096, ratio=1.5)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
    bucket_bytes=st.integers(4, 40000),
    ratio=st.floats(0.0, 1.0),
)
def test_properties(sizes, bucket_bytes, ratio):
    plan = plan_buckets(specs(sizes), bucket_bytes=bucket_bytes, ratio=ratio)
    members = [i for b in plan.buckets for i in b.param_indices]
    assert members == list(reversed(range(len(sizes))))  # every param once, backward order
    for b in plan.buckets:  # a bucket grows past the size only by one parameter it took in
        last = sizes[b.param_indices[-1]] * 4  # while it was less than half full
        assert b.nbytes <= bucket_bytes or len(b.param_indices) == 1 or (
            2 * (b.nbytes - last) < bucket_bytes)
    for a, b in zip(plan.buckets, plan.buckets[1:]):  # ...and a bucket closed only when
        first = sizes[b.param_indices[0]] * 4          # the next parameter overflowed it
        assert a.nbytes + first > bucket_bytes
    old = plan_buckets(specs(sizes), bucket_bytes=bucket_bytes, ratio=ratio, merge_small=False)
    for b in old.buckets:  # without merging: a bucket over the size is a single parameter
        assert b.nbytes <= bucket_bytes or len(b.param_indices) == 1
    assert len(plan.buckets) <= len(old.buckets)
    flags = [b.on_device for b in plan.buckets]
    assert flags == sorted(flags)  # host prefix, device suffix
    total = plan.total_numel
    best = min(abs(sum(b.numel for b in plan.buckets[:k]) - ratio * total)
               for k in range(len(plan.buckets) + 1))
    if 0 < ratio < 1:
        assert abs(plan.offloaded_fraction * total - ratio * total) == pytest.approx(best)


def test_small_buckets_ride_with_the_next_parameter() -> None:
    # registration order: big, tiny, tiny, big; backward meets them reversed
    sizes = [5000, 8, 8, 5000]
    old = plan_buckets(specs(sizes), bucket_bytes=8192, ratio=1.0, merge_small=False)
    new = plan_buckets(specs(sizes), bucket_bytes=8192, ratio=1.0)
    assert [b.param_indices for b in old.buckets] == [(3,), (2, 1), (0,)]
    assert [b.param_indices for b in new.buckets] == [(3,), (2, 1, 0)]  # no 64-byte bucket
