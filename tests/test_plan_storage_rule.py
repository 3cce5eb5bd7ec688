"""The storage tier's placement rule (plan/storage.py), pure: which buckets live in the file,
the pool, the file's layout, the host bytes -- checked against the figures derived by hand
from the layout the module docstring states, and against what an engine allocates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superoffload.plan.buckets import Bucket
from superoffload.plan.storage import ALIGN, ElementBytes, TierError, aligned, plan_tier

FP32 = ElementBytes(moment=4, grad=4, lp=0)
BF16 = ElementBytes(moment=2, grad=2, lp=2)


def buckets(*numels: int) -> list[Bucket]:
    return [Bucket(i, (i,), n, False) for i, n in enumerate(numels)]


def test_without_a_tier_everything_stays_in_memory_and_a_budget_is_only_checked() -> None:
    plan = plan_tier(buckets(1000, 2000), FP32, storage=False, budget_bytes=None,
                     buffer_count=4)
    assert plan.tier == () and plan.resident == (0, 1) and plan.slots == 0
    assert plan.file_bytes == 0 and plan.host_bytes == 16 * 3000  # master, m, v, gradient
    with pytest.raises(TierError, match="host_memory_budget_bytes=47,999 is below the "
                                        "48,000 bytes"):
        plan_tier(buckets(1000, 2000), FP32, storage=False, budget_bytes=47_999,
                  buffer_count=4)


def test_the_file_holds_two_versions_and_a_gradient_region_per_bucket_aligned() -> None:
    plan = plan_tier(buckets(1000, 5000, 300), FP32, storage=True, budget_bytes=None,
                     buffer_count=2)
    assert plan.tier == (0, 1, 2) and plan.resident == () and plan.slots == 2
    offset = 0
    for region, n in zip(plan.regions, (1000, 5000, 300)):
        state, grad = aligned(12 * n), aligned(4 * n)
        assert region.state_offsets == (offset, offset + state)
        assert region.grad_offset == offset + 2 * state and region.grad_bytes == grad
        assert all(o % ALIGN == 0 for o in (*region.state_offsets, region.grad_offset))
        offset += 2 * state + grad
    assert plan.file_bytes == offset
    # a slot fits the largest bucket's working set: state, then the gradient
    assert plan.slot.grad_offset == aligned(12 * 5000)
    assert plan.slot.nbytes == aligned(12 * 5000) + aligned(4 * 5000)
    assert plan.host_parts["storage_pool"] == 2 * plan.slot.nbytes
    assert plan.read_bytes() == sum(aligned(12 * n) for n in (1000, 5000, 300))
    assert plan.write_bytes(spill=True) == plan.read_bytes() + sum(
        aligned(4 * n) for n in (1000, 5000, 300))


def test_bf16_moments_and_host_casting_shrink_the_state_and_keep_the_copy_in_the_slot() -> None:
    plan = plan_tier(buckets(4096), BF16, storage=True, budget_bytes=None, buffer_count=1)
    (region,) = plan.regions
    assert region.state_bytes == aligned(8 * 4096)  # master 4 + m 2 + v 2
    assert plan.slot.lp_offset == aligned(8 * 4096) + aligned(2 * 4096)
    assert plan.slot.nbytes == plan.slot.lp_offset + aligned(2 * 4096)


def test_a_budget_keeps_the_buckets_backward_finishes_last_while_they_fit() -> None:
    sizes = (1000, 1000, 1000, 1000)
    slot = aligned(12 * 1000) + aligned(4 * 1000)
    budget = 2 * slot + 2 * 16 * 1000  # the pool and two whole buckets
    plan = plan_tier(buckets(*sizes), FP32, storage=True, budget_bytes=budget, buffer_count=2)
    assert plan.resident == (2, 3) and plan.tier == (0, 1)
    assert plan.host_bytes == budget
    smaller = plan_tier(buckets(*sizes), FP32, storage=True, budget_bytes=budget - 1,
                        buffer_count=2)
    assert smaller.resident == (3,)
    with pytest.raises(TierError, match="cannot hold the storage tier's pinned buffers: 2 x"):
        plan_tier(buckets(*sizes), FP32, storage=True, budget_bytes=2 * slot - 1,
                  buffer_count=2)


def test_when_everything_fits_the_budget_there_is_no_pool_and_no_file() -> None:
    plan = plan_tier(buckets(100, 100), FP32, storage=True, budget_bytes=10**9, buffer_count=4)
    assert plan.tier == () and plan.slots == 0 and plan.file_bytes == 0
    assert plan.host_parts["storage_pool"] == 0


def test_weight_flow_homes_stay_in_memory_for_tier_buckets() -> None:
    flow = ElementBytes(moment=4, grad=2, lp=2, home=2)
    plan = plan_tier(buckets(1000, 3000), flow, storage=True, budget_bytes=None,
                     buffer_count=2)
    assert plan.host_parts["weight_flow_homes"] == 2 * 4000
    assert plan.slot.nbytes == aligned(12 * 3000) + aligned(2 * 3000)  # the copy is the home


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50_000), min_size=1, max_size=12), st.integers(1, 6),
       st.integers(0, 3_000_000))
def test_a_plan_never_exceeds_its_budget_and_places_every_bucket_once(
        sizes: list[int], count: int, budget: int) -> None:
    try:
        plan = plan_tier(buckets(*sizes), FP32, storage=True, budget_bytes=budget,
                         buffer_count=count)
    except TierError:
        pool = min(count, len(sizes)) * (aligned(12 * max(sizes)) + aligned(4 * max(sizes)))
        assert budget < pool
        return
    assert sorted(plan.tier + plan.resident) == list(range(len(sizes)))
    assert plan.host_bytes <= budget
    if plan.resident:  # the resident ones are the last buckets, a suffix
        assert plan.resident == tuple(range(len(sizes) - len(plan.resident), len(sizes)))
