"""The bucket planner's boundaries, pinned on exact sizes: the cases random
property tests almost never draw (tests/test_buckets.py: 0 of 20 seeds hit exactly-full).

Sizes are in elements; a bucket's bound is in fp32 gradient bytes (4 B/param).
"""

from __future__ import annotations

import pytest

from superoffload.plan.buckets import ParamSpec, plan_buckets


def specs(sizes: list[int]) -> list[ParamSpec]:
    return [ParamSpec(i, n, True, f"p{i}") for i, n in enumerate(sizes)]


def members(sizes: list[int], bucket_bytes: int, *, merge_small: bool = True,
            ratio: float = 1.0) -> list[tuple[int, ...]]:
    plan = plan_buckets(specs(sizes), bucket_bytes=bucket_bytes, ratio=ratio,
                        merge_small=merge_small)
    return [b.param_indices for b in plan.buckets]


@pytest.mark.parametrize("merge_small", [True, False])
def test_a_bucket_filled_exactly_to_the_bound_stays_one_bucket(merge_small: bool) -> None:
    # 1024 + 1024 params = 8192 B: exactly full, "up to bucket_bytes" includes the bound
    assert members([1024, 1024], 8192, merge_small=merge_small) == [(1, 0)]
    # one element more overflows it: the second parameter starts a new bucket (the first
    # bucket, 4100 B, is more than half full, so it is not merged)
    assert members([1024, 1025], 8192, merge_small=merge_small) == [(1,), (0,)]


def test_a_bucket_exactly_half_full_is_closed_not_merged() -> None:
    # backward order: p1 (4096 B: exactly half of 8192) then p0 (8192 B) would overflow.
    # Merging applies to a bucket *less than* half full (plan_buckets' docstring)
    assert members([2048, 1024], 8192) == [(1,), (0,)]
    # one element less than half: p0 rides with it, the bucket grows past the bound
    assert members([2048, 1023], 8192) == [(1, 0)]
    assert members([2048, 1023], 8192, merge_small=False) == [(1,), (0,)]


def test_ratio_ties_go_to_offloading_more() -> None:
    # four equal buckets, ratio 0.375: 1 bucket (0.25) and 2 buckets (0.5) are equally far
    # from the target; the documented tie-break offloads more (the paper's bias, ratio ~0.9)
    plan = plan_buckets(specs([1024] * 4), bucket_bytes=4096, ratio=0.375)
    assert [b.on_device for b in plan.buckets] == [False, False, True, True]
    # off the tie the nearest wins either way
    assert len(plan_buckets(specs([1024] * 4), bucket_bytes=4096, ratio=0.37).host_buckets) == 1
    assert len(plan_buckets(specs([1024] * 4), bucket_bytes=4096, ratio=0.38).host_buckets) == 2
