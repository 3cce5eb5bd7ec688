"""Building the engine's buckets: the schedule in force and the buffers it allocates.

When the engine starts, after a load, a re-plan (``reconfigure`` of a "replan" field, a
weight policy switch, ``add_param_group``): resolve where offloaded gradients accumulate
(``decide_grad_accum``), the schedule (``plan.schedule.resolve_schedule``, the rule the
planner predicts with), the casting, and let the transport allocate every bucket from
placement-free states. Between iterations only (the lanes drained); never on the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.plan.schedule import Schedule, ScheduleFacts, engine_for, resolve_schedule
from superoffload.plan.storage import keeps_copies
from superoffload.runtime.casting import CastPolicy, cast_policy
from superoffload.runtime.contract import Contract
from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.engine_state import EngineState, InitialStates, ParamState
from superoffload.runtime.host_memory import return_freed_memory
from superoffload.runtime.tier_open import Storage
from superoffload.runtime.transport import Transport
from superoffload.runtime.weight_policy import WeightPolicyController
from superoffload.telemetry.recorder import Recorder
from superoffload.threads import usable_cores


class Builder(Protocol):
    """What building reads and sets of its engine (runtime/engine.py implements it)."""

    config: OffloadConfig
    state: EngineState
    device_ops: DeviceOps
    transport: Transport
    contract: Contract
    telemetry: Recorder
    weights: WeightPolicyController
    accum_on_host: bool
    cast: CastPolicy | None
    iteration: int

    @property
    def model_dtype(self) -> torch.dtype: ...

    @property
    def schedule(self) -> Schedule: ...

    def synchronize(self) -> None: ...

    def rebuild(self) -> None: ...

    def forget_iteration(self) -> None:
        """Forget a partial iteration (the buckets it launched are gone)."""
        ...


def decide_grad_accum(config: OffloadConfig, device_type: str, transport: Transport,
                      shape: Callable[[], Any], profile: Callable[[], Any],
                      weights: str) -> tuple[str, str]:
    """(where offloaded gradients accumulate, why "auto" chose it or ""): "device" or
    "host". Without accumulation, or on a CPU-only machine (one memory: nothing to save),
    "device"; on a GPU the planner's cost model decides (``plan.grad_accum``), asked with
    the model's shape, the engine's hardware profile as this rank sees it (ranks on one host
    share it) and the weight policy in force (called only then)."""
    place, why = config.grad_accum_on, ""
    if config.grad_accum_steps == 1:
        return "device", ""
    # the tier exists to keep host sums out of memory
    if config.storage_path is not None:
        if place == "host":
            raise ConfigError(
                "OffloadConfig.grad_accum_on='host' keeps every offloaded bucket's fp32 "
                "gradient sum in host memory, which storage_path exists to avoid; use "
                "grad_accum_on='device' (or 'auto')")
        return "device", "the storage tier keeps no gradient sums in host memory"
    if place == "auto":
        place, why = "device", "the device is the CPU: one memory, nothing to save"
        if device_type == "cuda":
            from superoffload.plan.grad_accum import choose_grad_accum
            from superoffload.plan.parallel import rank_profile

            choice = choose_grad_accum(shape(), rank_profile(profile(), transport.local_ranks),
                                       config.replace(weights=weights))
            place, why = choice.place, choice.reason
            # the planner's choice, overruled: a transport that sums on the device (FSDP2's
            # reduce-scatter) has no host buffer to accumulate into
            if place == "host" and not transport.accumulates_on_host:
                place = "device"
                why = f"{why}; but the {transport.name!r} transport sums on the device"
    if place == "host" and not transport.accumulates_on_host:
        raise ConfigError(
            f"OffloadConfig.grad_accum_on='host' is not supported by the {transport.name!r} "
            "transport; use grad_accum_on='device'")
    return place, why



def facts_of(engine: Any) -> ScheduleFacts:
    """What the engine's schedule is resolved from: its parameters, dtype, device, the ranks
    over which gradients are summed, the cores, and the hardware profile only when "auto"
    casting asks the cost model (on a GPU). The planner's rule: it predicts this engine."""
    cfg, device = engine.config, engine.device_ops.device
    auto_cast = "auto" in (cfg.grad_cast, cfg.param_cast) \
        and engine.state.model_dtype != torch.float32
    return ScheduleFacts(
        params=engine.state.param_specs(), model_dtype=engine.state.dtype_name,
        device_type=device.type, dp=engine.transport.grad_divisor,
        usable_cores=usable_cores(), local_ranks=engine.transport.local_ranks,
        profile=engine.weights.profile() if device.type == "cuda" and auto_cast else None,
        engine=engine_for(cfg))


def build(engine: Builder, states: Mapping[int, ParamState], facts: ScheduleFacts) -> None:
    """Resolve the schedule on ``facts`` and (re)allocate every bucket from placement-free
    ``states``."""
    st, cfg = engine.state, engine.config
    weights = engine.weights
    place, why = decide_grad_accum(cfg, engine.device_ops.device.type, engine.transport,
                                   weights.shape_for_planning, weights.profile, weights.active)
    # "auto": the planner's cost model decided
    if why:
        engine.telemetry.note(engine.iteration, f"grad_accum_on='auto': {place} ({why})")
    schedule = resolve_schedule(cfg, facts, weights=weights.active, grad_accum=place)
    engine.accum_on_host = place == "host"
    cast = engine.cast = cast_policy(schedule, engine.model_dtype,
                                     accum_on_host=engine.accum_on_host)
    st.schedule = schedule
    st.bucket_of = {i: b.id for b in schedule.bucket_plan.buckets for i in b.param_indices}
    budgeted = cfg.storage_path is not None or cfg.host_memory_budget_bytes is not None
    if cfg.host_memory_budget_bytes is not None:
        # what the engine frees leaves the process (host_memory.py)
        return_freed_memory()
    moments = torch.float32
    if cfg.optimizer_state_dtype == "bf16":
        moments = torch.bfloat16
    st.buffers = engine.transport.build(
        schedule.bucket_plan, states, cast, flow=schedule.weights == "flow",
        snapshot=keeps_copies(cfg.rollback, cfg.speculation),  # what a budget must hold
        moments=moments, storage=Storage.of(cfg) if budgeted else None)
    # InitialStates makes fresh states only when read: their step is 0, no need to make them
    initial = isinstance(states, InitialStates)
    for i in st.trainable:
        st.steps[i] = 0 if initial else states[i].step
    # storages may have moved (a weight policy switch)
    engine.contract.rebase(st.trainable)
    engine.forget_iteration()
    for note in schedule.notes:
        engine.telemetry.note(engine.iteration, note)


def refresh(engine: Builder, facts: ScheduleFacts) -> None:
    """Re-resolve the schedule for changed "live" fields (threads); re-plan only when the
    buckets or the casting change."""
    schedule = resolve_schedule(engine.config, facts, weights=engine.weights.active,
                                grad_accum=engine.schedule.grad_accum_on)
    old = engine.schedule
    if (schedule.bucket_plan, schedule.grad_cast, schedule.param_cast) != (
            old.bucket_plan, old.grad_cast, old.param_cast):
        engine.synchronize()
        engine.rebuild()
    else:
        engine.state.schedule = schedule
