"""Which SuperOffload techniques a simulated run uses, and the concrete schedule they resolve to.

`Techniques` is the ablation switchboard (paper §4; DESIGN.md §1 table):
  buckets      §4.2 fixed-size buckets offloaded and stepped as backward produces them; off = one
               whole-model transfer and step, as ZeRO-Offload does
  gpu_tail     §4.2 the last (1 - ratio) of the gradient bytes stay on the device; off = ratio 1
  stv          §4.3 speculation-then-validation: CPU steps start before the global norm is known;
               off = the CPU waits for validation after backward. `rollback_rate` is the share of
               iterations that clip or overflow and pay a rollback + replay
  casting      §4.4 "superchip": the cost model (or the config) picks the cast side per direction;
               "host": ZeRO-Offload's choice, bf16 over the link and casts on the CPU
  adaptive_weights  §4.5 honour config.weights ("auto" lets the cost model pick flow vs stationary);
               off = weight-stationary
  kernel       §4.6 "ours" (GraceAdam-class), "deepspeed" (CPUAdam), "torch" (PyTorch CPU Adam)
  engine       not a technique: how the engine implements the schedule (plan.schedule.
               EngineVariant: FIFO or earliest-deadline-first stepping, unfused or fused GPU
               tail step); None = what the engine runs for the config (plan.schedule.
               engine_for: ENGINE with the step order OffloadConfig.step_order selects, as
               runtime/engine.py resolves it); a variant given here is used as it is

`resolve` asks the one rule book (plan.schedule.resolve_schedule) what the engine runs for a
config on the model's real parameter list -- effective ratio (1 under weight-flow, also with
data parallel), buckets of whole parameters, casting, threads, and with data parallel the
FSDP2 units ``FsdpOffloadEngine`` shards the model into -- and applies the ablation switches
on top. The "zero-offload" system is the peer users run, DeepSpeed ZeRO-2 with
``offload_optimizer`` (plan/deepspeed.py); "gpu" is plain PyTorch with a fused AdamW.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from superoffload.config import OffloadConfig
from superoffload.plan import cost
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.schedule import (
    ENGINE_H200_MEASURED,
    EngineVariant,
    ScheduleFacts,
    engine_for,
    resolve_schedule,
)
from superoffload.plan.shapes import ModelShape
from superoffload.plan.storage import keeps_copies

System = Literal["superoffload", "zero-offload", "gpu"]
"""What a simulation models: SuperOffload (the engine), DeepSpeed ZeRO-2 with offload_optimizer
(plan/deepspeed.py), or plain PyTorch with everything on the GPU."""
SYSTEMS: tuple[System, ...] = get_args(System)


# Clipping frequency the paper reports for BLOOM-176B pre-training: 93 of ~79,000 steps (FACTS.md).
PAPER_CLIP_RATE = 93 / 79_000


Casting = Literal["superchip", "host"]
"""Where the ablation casts: as the rule book decides on a Superchip, or everything on the host."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Techniques:
    """Switches for the ablation; the default is full SuperOffload."""

    buckets: bool = True
    gpu_tail: bool = True
    stv: bool = True
    rollback_rate: float = PAPER_CLIP_RATE
    casting: Casting = "superchip"
    adaptive_weights: bool = True
    kernel: cost.Kernel = "ours"
    engine: EngineVariant | None = None
    """The engine variant to simulate, as given (its step order wins over the config's);
    None: the one the engine runs for the config (``plan.schedule.engine_for(config)``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rollback_rate <= 1.0:
            raise ValueError(f"Techniques.rollback_rate={self.rollback_rate}: use a fraction in "
                             "[0, 1]")
        if self.casting not in get_args(Casting):
            raise ValueError(f"Techniques.casting={self.casting!r}: use "
                             f"{' or '.join(repr(c) for c in get_args(Casting))}")
        if self.kernel not in cost.KERNELS:
            raise ValueError(f"Techniques.kernel={self.kernel!r}: use one of {cost.KERNELS}")
        if self.engine is not None and not isinstance(self.engine, EngineVariant):
            raise ValueError(f"Techniques.engine={self.engine!r}: use a plan.schedule."
                             "EngineVariant (ENGINE, ENGINE_H200_MEASURED) or None")

    def replace(self, **changes: Any) -> Techniques:
        return dataclasses.replace(self, **changes)


ZERO_OFFLOAD = Techniques(buckets=False, gpu_tail=False, stv=False, casting="host",
                          adaptive_weights=False, kernel="deepspeed")
"""ZeRO-Offload (Ren et al. 2021) as the paper describes it, on our schedule: step after
backward, whole-model transfers of bf16, casts on the CPU, DeepSpeed's CPUAdam, weights stay
on the device. The ablation's starting point; the "zero-offload" *system* is the real peer
(DeepSpeed ZeRO-2 with offload_optimizer, plan/deepspeed.py)."""

ENGINE_FUSED = dataclasses.replace(ENGINE_H200_MEASURED, tail_step="fused")
"""The "gpu" system's variant: plain PyTorch's ``AdamW(fused=True)`` is one fused step over
the parameters' buckets as ``plan_buckets`` cuts them without merging (the variant the plain
row of FACTS.md was fitted with: profiles_measured.ACHIEVED_TFLOPS). Nothing is offloaded, so
step order and D2H launch order do not apply."""
__all__ = ["PAPER_CLIP_RATE", "SYSTEMS", "ZERO_OFFLOAD", "Casting", "System", "Techniques",
           "resolve"]


def resolve(shape: ModelShape, prof: HardwareProfile, system: str,
            config: OffloadConfig | None, techniques: Techniques | None, *,
            auto: Any = None, accum: Any = None) -> Resolved:
    """Turn (system, config, techniques) into a Resolved schedule: the rule book decides what
    the engine runs (plan.schedule), then the ablation switches apply. 'auto' fields ask the
    cost model; ``auto``: the WeightChoice for weights="auto"; ``accum``: the GradAccumChoice
    for grad_accum_on="auto" (plan.grad_accum.resolve_decided decides it first; without one
    the rule book accumulates on the device and says so). "zero-offload" is DeepSpeed
    ZeRO-2 + offload_optimizer and ignores
    `techniques` (but its rollback_rate); "gpu" keeps everything on the device."""
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r}: use one of {', '.join(SYSTEMS)}")
    from superoffload.plan.size_limit import check_size  # before any per-parameter work

    check_size(shape, config)
    cfg = (config or OffloadConfig()).validate()
    tech = techniques or Techniques()
    if system == "zero-offload":
        from superoffload.plan import deepspeed

        return deepspeed.resolve_zero2(shape, prof, cfg, tech.rollback_rate)
    reasons: list[str] = []
    changes: dict[str, Any] = {}
    weights = "stationary"
    if tech.adaptive_weights and system == "superoffload":
        if cfg.weights == "auto":
            # the engine's rule (plan.choose_weights) simulates both policies, so the caller
            # decides it: plan.simulate does, passing `auto` (no import cycle through here)
            if auto is None:
                raise ValueError("resolve: config.weights='auto' must be decided first; "
                                 "plan.simulate does it with plan.choose_weights")
            weights = auto.policy
            reasons.append(auto.reason)
        else:
            weights = cfg.weights
    if not tech.gpu_tail:
        changes["ratio"] = 1.0
    if system == "gpu":
        changes["ratio"] = 0.0
    if tech.casting == "host":
        changes.update(grad_cast="host", param_cast="host")
    elif tech.kernel != "ours" and "auto" in (cfg.grad_cast, cfg.param_cast) \
            and prof.device_type == "cuda":
        # the rule book's "auto" asks the cost model for our kernel; an ablation with another
        # kernel asks it for that kernel (which fuses fewer casts)
        threads = cost.cpu_threads(prof, cfg.cpu_threads, cfg.cpu_cores_frac)
        # bucket_bytes / 4: a bucket's parameters, as fp32 sizes them
        g, p, why = cost.choose_casting(prof, tech.kernel, threads, cfg.bucket_bytes / 4,
                                        cfg.optimizer_state_dtype)
        # only the sides the user left on "auto" are decided; a set side stays as set
        if cfg.grad_cast != "auto":
            g = cfg.grad_cast
        if cfg.param_cast != "auto":
            p = cfg.param_cast
        changes.update(grad_cast=g, param_cast=p)
        reasons.append(why)
    # the engine's own rule (runtime/engine.py)
    engine = tech.engine or engine_for(cfg)
    if system == "gpu":
        # plain PyTorch: torch.optim.AdamW(fused=True)
        engine = ENGINE_FUSED
    # FsdpOffloadEngine's units: only our schedule runs FSDP2 with data parallel
    fsdp = shape.dp > 1 and system == "superoffload"
    blocks = shape.block_of_params() if fsdp else None
    # prof is already this rank's share of the host (parallel.rank_profile), hence local_ranks=1
    facts = ScheduleFacts(params=shape.param_specs(), model_dtype=shape.dtype,
                          device_type=prof.device_type, dp=shape.dp,
                          usable_cores=prof.cpu_cores, local_ranks=1, profile=prof,
                          engine=engine, blocks=blocks)
    if accum is not None and cfg.grad_accum_on == "auto":
        reasons.append(accum.reason)
    decided = cfg.replace(**changes) if changes else cfg
    place = None if accum is None else accum.place
    rules = resolve_schedule(decided, facts, weights=weights, grad_accum=place)
    reasons.extend(rules.notes)
    if cfg.speculation == "adaptive":
        speculate = tech.stv and tech.rollback_rate < cfg.adaptive_threshold
    else:
        speculate = tech.stv and cfg.speculation == "on"
    if system == "gpu":
        speculate = False
    return Resolved(
        system=system,
        bucket_bytes=int(cfg.bucket_bytes),
        whole_model_bucket=not tech.buckets,
        ratio=float(rules.ratio),
        speculate=bool(speculate),
        rollback_rate=tech.rollback_rate,
        grad_cast=rules.grad_cast,
        param_cast=rules.param_cast,
        weights=rules.weights,
        kernel=tech.kernel,
        threads=rules.threads,
        prefetch_depth=cfg.prefetch_depth,
        snapshot_rollback=cfg.rollback == "snapshot",
        pre_step_copies=keeps_copies(cfg.rollback, cfg.speculation) and bool(speculate),
        # plain PyTorch's AdamW keeps fp32 moments whatever the config says
        optimizer_state_dtype="fp32" if system == "gpu" else cfg.optimizer_state_dtype,
        bucket_plan=rules.bucket_plan,
        engine=rules.engine,
        requested_ratio=float(cfg.ratio),
        model_dtype=shape.dtype,
        grad_buckets_in_flight=cfg.grad_buckets_in_flight,
        keep_device_grads=cfg.keep_device_grads,
        grad_accum_steps=cfg.grad_accum_steps,
        grad_accum_on=rules.grad_accum_on,
        units=rules.units,
        reasons=tuple(reasons),
        storage=system == "superoffload" and cfg.storage_path is not None,
        host_budget_bytes=cfg.host_memory_budget_bytes,
        storage_buffer_count=cfg.storage_buffer_count,
        storage_queue_depth=cfg.storage_queue_depth,
        weight_homes=cfg.weight_homes,
    )
