"""The planner's use of the storage tier: the configuration that asks for it, and what it
costs one optimizer step (DESIGN.md §7: the planner says how many tokens per step hide the
storage traffic; docs/planner.md, "The storage tier").

``tier_config`` is the ``OffloadConfig`` change the tuner, ``plan`` and ``capacity`` try when
the tier is allowed: a ``storage_path`` (a placeholder: the planner needs no folder, the user
names one) and a host memory budget of what this job's GPU may use of the host (its share, less
the headroom the fit check keeps), so the buckets that fit stay in memory and the rest go to the
tier (plan/storage.py's rule); on one memory pool, no budget. ``tier_cost`` adds up the tier's
traffic of one optimizer step -- what plan/sim_storage.py's lane carries -- and the tokens per
step whose forward and backward take as long: with fewer, the step waits for the drives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from superoffload.plan import compute
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory import HOST_HEADROOM
from superoffload.plan.memory_host import host_side, planned_homes
from superoffload.plan.parallel import rank_profile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.sim_storage import rates_bps

STORAGE_PLACEHOLDER = "<a folder on the storage tier>"
"""The ``storage_path`` of a planned configuration: the planner needs none; replace it."""


def tier_config(shape: ModelShape, prof: HardwareProfile) -> dict[str, Any]:
    """``OffloadConfig`` fields that put what does not fit in host memory on the tier. On one
    memory pool (``shared_memory``) the device draws on the same memory, so no budget would
    leave it its share: every offloaded bucket goes to the tier."""
    share = rank_profile(prof, shape.ranks_per_host)
    budget = None
    if not prof.shared_memory:
        # this rank's share less the fit check's headroom, so a plan that fits stays fitting
        budget = int(share.host_memory_bytes * HOST_HEADROOM)
    return {"storage_path": STORAGE_PLACEHOLDER, "host_memory_budget_bytes": budget}


@dataclass(frozen=True, slots=True)
class TierCost:
    """The storage tier's traffic in one optimizer step and the tokens that hide it."""

    read_bytes: float
    write_bytes: float
    io_s: float
    """Seconds of the lane (reads at the read rate, writes at the write rate: one lane)."""
    compute_s_per_token: float
    """Forward and backward seconds per token of this rank."""
    tokens_needed: int
    """Tokens per optimizer step whose forward and backward take ``io_s``."""
    tokens_per_step: int
    """What the shape gives: seq x micro_batch x grad_accum_steps (per rank)."""

    @property
    def hidden(self) -> bool:
        return self.tokens_per_step >= self.tokens_needed


def tier_cost(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> TierCost | None:
    """What the tier costs ``plan``'s optimizer step on ``prof`` (this rank's share); None
    when nothing is on the tier."""
    prof = rank_profile(prof, shape.ranks_per_host)
    dp = shape.dp if plan.units is not None else 1
    side = host_side(shape, plan, dp)
    tier = side.tier
    read = write = 0.0
    if tier is not None and tier.tier:
        state = sum(r.state_bytes for r in tier.regions)
        grad = sum(r.grad_bytes for r in tier.regions)
        # speculation: state read, state + gradient written; without it the state is read
        # again with the gradient for the step after the verdict (plan/sim_storage.py)
        if plan.speculate:
            read = state
        else:
            read = 2 * state + grad
        write = state + grad
    homes = planned_homes(plan)
    if tier is not None and homes is not None:
        # homes in the file (inside the state, so written with it): every fetch reads them,
        # before forward and again before backward
        read += 2 * tier.home_bytes(homes.stream)
    if read == 0 and write == 0:
        return None
    read_bps, write_bps = rates_bps(prof, plan)
    io_s = read / read_bps + write / write_bps
    tokens = shape.seq * shape.micro_batch
    per_token = compute.iteration_compute_s(shape, prof) / tokens
    return TierCost(read, write, io_s, per_token, math.ceil(io_s / per_token),
                    tokens * plan.grad_accum_steps)
