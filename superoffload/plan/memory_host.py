"""Host and storage bytes of the offloaded buckets, by the engine's own rule (DESIGN.md §7).

What the host keeps for the offloaded buckets -- resident state, gradient buffers, the
low-precision copies, a snapshot, the storage tier's pinned pool, weight-flow's homes and the
staging buffers of homes in the files -- is decided by one pure rule,
``plan.storage.plan_tier``, which the engine (runtime/tier_open.py) allocates from; this
module only feeds it the planner's resolved schedule, so the planner charges what the engine
allocates, byte for byte:

  per element of a bucket (``ElementBytes``, the engine's dtypes)
    moment  4 B (fp32 moments) or 2 (``optimizer_state_dtype="bf16"``), m and v each
    grad    4 B (fp32 gradient buffer), or the model dtype's 2 when gradients are cast on the
            host (and do not accumulate there: an fp32 sum)
    lp      the low-precision weight copy the kernel writes when parameters are cast on the
            host (the model dtype's 2 B; 0 for an fp32 model or a device-side cast)
    home    weight-flow: the streamed weights' home in host memory (= lp)
  resident bucket: 4 (master) + 2 moments + grad + lp (+ the state again as a snapshot)
  tier bucket:     nothing per element in memory but its home; one pool slot holds the
                   largest tier bucket's working set, ``storage_buffer_count`` slots
  files:           2 versions of the state + the gradient per tier element (plan/storage.py)

Weight-flow's homes on the tier (``OffloadConfig.weight_homes``, the rule's ``Homes``): a tier
bucket's home may live in the file as part of its state (master | m | v | lp), read through
``prefetch_depth + 1`` staging buffers ahead of forward and backward; "auto" files the fewest,
the buckets backward finishes first (the last blocks) first, when the budget cannot hold them
all -- so the planner's choice between device (stationary), host and storage for the weights
is the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from superoffload.plan.buckets import Bucket
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.storage import ElementBytes, Homes, TierError, TierPlan, plan_tier

MOMENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of one Adam moment on the host, by OffloadConfig.optimizer_state_dtype."""


@dataclass(frozen=True, slots=True)
class HostSide:
    """The offloaded buckets' bytes off the device: ``plan_tier``'s answer and the planner's
    weight homes on the tier."""

    tier: TierPlan | None
    """The rule's plan (None: nothing offloaded)."""
    host_parts: dict[str, float] = field(default_factory=dict)
    """Host bytes by part (the engine's names, plan/storage.py)."""
    storage_parts: dict[str, float] = field(default_factory=dict)
    """Bytes in the storage tier's files by part."""
    refusal: str = ""
    """Why the engine would refuse the setting at ``initialize`` (a budget too small);
    ``host_parts`` then say what it would need without the budget."""


def element_of(plan: Resolved) -> ElementBytes:
    """Bytes per element of an offloaded bucket as the engine allocates them
    (runtime/tier_open.element_bytes from the resolved casting)."""
    w = 4 if plan.model_dtype == "float32" else 2
    low = w == 2
    accum_host = plan.grad_accum_on == "host" and plan.grad_accum_steps > 1
    if low and plan.grad_cast == "host" and not accum_host:
        # 16-bit gradients land as they are; the kernel widens them in its pass (§4.4)
        grad = w
    else:
        # fp32: cast on the device, an fp32 model, or a host accumulation buffer (which
        # sums micro-steps in fp32)
        grad = 4
    # the 16-bit weight copy the kernel writes only when parameters are cast on the host
    lp = w if low and plan.param_cast == "host" else 0
    flow = plan.weights == "flow"
    return ElementBytes(moment=MOMENT_BYTES[plan.optimizer_state_dtype], grad=grad, lp=lp,
                        snapshot=plan.speculate and plan.pre_step_copies,
                        # weight-flow streams the blocks from that copy: it is their home
                        home=lp if flow else 0)


def staging_bytes_per_element(plan: Resolved, low: bool) -> float:
    """Device bytes per element of an offloaded bucket (or shard) in flight for the fp32 copies
    of device-side casting: 4 B for each direction cast on the device (§4.4); none for an fp32
    model."""
    if not low:
        return 0.0
    return 4.0 * ((plan.grad_cast == "device") + (plan.param_cast == "device"))


def host_buckets(plan: Resolved, dp: int = 1) -> list[Bucket]:
    """The offloaded buckets with this rank's elements (``dp`` > 1: FSDP2 shards, ceil);
    the ablation without buckets offloads one whole-model bucket."""
    host = list(plan.bucket_plan.host_buckets)
    if plan.whole_model_bucket and host:
        host = [Bucket(0, tuple(i for b in host for i in b.param_indices),
                       sum(b.numel for b in host), False)]
    if dp > 1:
        # ceil: FSDP2 pads the last shard, so every rank holds the largest share
        host = [Bucket(b.id, b.param_indices, -(-b.numel // dp), False) for b in host]
    return host


def planned_homes(plan: Resolved) -> Homes | None:
    """Weight-flow's homes for the rule, as the engine builds them (runtime/tier_open.homes_of):
    the model dtype streamed through ``prefetch_depth + 1`` buffers; None without weight-flow."""
    if plan.weights != "flow":
        return None
    # an fp32 model streams its master (4 B per element); others their 16-bit weights
    stream = 4 if plan.model_dtype == "float32" else 2
    return Homes(plan.weight_homes, stream,  # type: ignore[arg-type]
                 plan.prefetch_depth + 1)


def host_side(shape: ModelShape, plan: Resolved, dp: int = 1) -> HostSide:
    """The offloaded buckets' host and storage bytes (module docstring)."""
    buckets = host_buckets(plan, dp)
    if plan.system == "gpu" or not buckets:
        return HostSide(None)
    element, homes = element_of(plan), planned_homes(plan)

    def rule(budget: int | None) -> TierPlan:
        return plan_tier(buckets, element, storage=plan.storage, budget_bytes=budget,
                         buffer_count=plan.storage_buffer_count, homes=homes)

    try:
        tier, refusal = rule(plan.host_budget_bytes), ""
    except TierError as exc:
        # what it would need without the budget, and why not
        tier, refusal = rule(None), str(exc)
    host = {name: float(v) for name, v in tier.host_parts.items() if v}
    storage: dict[str, float] = {}
    if tier.tier:
        # files exist only when some bucket's state lives on the tier
        storage = {"state_files": float(tier.file_bytes)}
    return HostSide(tier, host, storage, refusal)


def file_home_numel(shape: ModelShape, plan: Resolved, tier: TierPlan | None,
                    dp: int = 1) -> np.ndarray:
    """Per layer: elements whose weight-flow home is in the tier's file (a fetch of the layer
    reads them from the file first); zeros without such homes."""
    layer, numel = shape.param_layout()
    out = np.zeros(shape.layers + 2)
    if tier is None or not tier.file_homes:
        return out
    filed = set(tier.file_homes)
    for b in plan.bucket_plan.host_buckets:
        if b.id in filed:
            idx = list(b.param_indices)
            np.add.at(out, layer[idx], numel[idx] / dp)
    return out
