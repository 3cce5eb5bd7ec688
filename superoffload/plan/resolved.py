"""The concrete schedule one simulation runs (plan/techniques.py resolves it; the DeepSpeed
peer, plan/deepspeed.py, too — a module of its own so neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from superoffload.plan import cost
from superoffload.plan.buckets import BucketPlan
from superoffload.plan.fsdp_units import UnitPlan
from superoffload.plan.schedule import ENGINE, EngineVariant


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """The concrete schedule one simulation runs (every 'auto' decided, every rule applied)."""

    system: str
    """What is simulated: "superoffload", "zero-offload" or "gpu" (``plan.techniques.System``)."""
    bucket_bytes: int
    """Bytes of fp32 gradient per bucket (4 B/param), as OffloadConfig.bucket_bytes."""
    whole_model_bucket: bool
    """Ablation (buckets off): the offloaded parameters move and step as one bucket."""
    ratio: float
    """The effective ratio the buckets were planned with (1 under weight-flow)."""
    speculate: bool
    rollback_rate: float
    grad_cast: str
    param_cast: str
    weights: str
    kernel: cost.Kernel
    threads: int
    prefetch_depth: int
    snapshot_rollback: bool
    pre_step_copies: bool = False
    """Speculative steps keep pre-step copies of p, m, v of the buckets in host memory at
    worst (plan.storage.keeps_copies: snapshot rollback, or "auto"'s rescue in the first
    steps): the host figure and a budget hold them."""
    bucket_plan: BucketPlan
    """The engine's bucket table (plan.buckets.plan_buckets over whole parameters)."""
    engine: EngineVariant = ENGINE
    optimizer_state_dtype: str = "fp32"
    """Dtype of the host's Adam moments ("fp32" or "bf16" with stochastic rounding;
    OffloadConfig.optimizer_state_dtype). GPU tail buckets keep fp32 moments."""
    requested_ratio: float = 0.9
    """OffloadConfig.ratio as asked."""
    model_dtype: str = "bfloat16"
    grad_buckets_in_flight: int = 2
    """OffloadConfig.grad_buckets_in_flight: offloaded buckets whose gradients may wait for
    their D2H copy on the device (plan/device_grads.py)."""
    keep_device_grads: bool = False
    """OffloadConfig.keep_device_grads: offloaded gradients stay on the device too."""
    grad_accum_steps: int = 1
    """OffloadConfig.grad_accum_steps: micro-steps per optimizer step."""
    grad_accum_on: str = "device"
    """Where offloaded gradients accumulate over micro-steps, decided ("device" or "host";
    the rule book resolves "auto" with plan.grad_accum.choose_grad_accum)."""
    storage: bool = False
    """``OffloadConfig.storage_path`` is set: offloaded buckets' state may live in files on the
    storage tier (plan/storage.py decides which, plan/memory_host.py charges it)."""
    host_budget_bytes: int | None = None
    """``OffloadConfig.host_memory_budget_bytes``: the cap on what the engine keeps in host
    memory, per rank."""
    storage_buffer_count: int = 4
    """``OffloadConfig.storage_buffer_count``: pool slots, one tier bucket's working set each."""
    storage_queue_depth: int = 32
    """``OffloadConfig.storage_queue_depth``: the tier's requests in flight (below what the
    profile's drives need, the rates scale down: plan/sim_storage.py)."""
    weight_homes: str = "auto"
    """``OffloadConfig.weight_homes``: where weight-flow keeps the tier buckets' weights
    ("host", "storage" or "auto"; plan/storage.py's rule decides "auto" from the budget)."""
    units: UnitPlan | None = None
    """Data parallel: the FSDP2 units and the buckets each holds (the rule book's
    ``Schedule.units``); None for one process and for the peers' schedules."""
    reasons: tuple[str, ...] = ()
    host_numel: int = field(init=False, default=0)
    """Parameters whose fp32 state and step are on the host (whole buckets; derived)."""
    device_numel: int = field(init=False, default=0)
    """Parameters stepped on the device (derived)."""

    def __post_init__(self) -> None:
        host = sum(b.numel for b in self.bucket_plan.buckets if not b.on_device)
        object.__setattr__(self, "host_numel", host)
        object.__setattr__(self, "device_numel", self.bucket_plan.total_numel - host)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe fields (the bucket table as counts)."""
        fields = self.__slots__  # type: ignore[attr-defined]
        # the bucket table, the engine variant and the units are objects: summarised below
        out: dict[str, Any] = {k: getattr(self, k) for k in fields
                               if k not in ("bucket_plan", "engine", "units")}
        out["reasons"] = list(self.reasons)
        out["engine"] = {"step_order": self.engine.step_order, "tail_step": self.engine.tail_step,
                         "d2h_stats_first": self.engine.d2h_stats_first,
                         "merge_small_buckets": self.engine.merge_small_buckets,
                         "buckets_per_unit": self.engine.buckets_per_unit}
        plan = self.bucket_plan
        n_host = sum(1 for b in plan.buckets if not b.on_device)
        out["buckets"] = {"host": n_host, "device": len(plan.buckets) - n_host,
                          "largest_numel": max((b.numel for b in plan.buckets), default=0)}
        if self.units is not None:
            out["fsdp_units"] = [{"params": len(u.param_indices), "numel": u.numel,
                                  "on_host": u.on_host, "all_gathers": u.all_gathers,
                                  "buckets": list(u.buckets)} for u in self.units.units]
        return out
