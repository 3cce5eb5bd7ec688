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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from superoffload.config import OffloadConfig
from superoffload.plan import cost
from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.shapes import ModelShape

Schedule = Literal["superoffload", "zero-offload", "gpu"]
SCHEDULES: tuple[str, ...] = ("superoffload", "zero-offload", "gpu")

# Clipping frequency the paper reports for BLOOM-176B pre-training: 93 of ~79,000 steps (FACTS.md).
PAPER_CLIP_RATE = 93 / 79_000


@dataclass(frozen=True, kw_only=True, slots=True)
class Techniques:
    """Switches for the ablation; the default is full SuperOffload."""

    buckets: bool = True
    gpu_tail: bool = True
    stv: bool = True
    rollback_rate: float = PAPER_CLIP_RATE
    casting: Literal["superchip", "host"] = "superchip"
    adaptive_weights: bool = True
    kernel: cost.Kernel = "ours"

    def __post_init__(self) -> None:
        if not 0.0 <= self.rollback_rate <= 1.0:
            raise ValueError(f"Techniques.rollback_rate={self.rollback_rate}: use a fraction in [0, 1]")
        if self.casting not in ("superchip", "host"):
            raise ValueError(f"Techniques.casting={self.casting!r}: use 'superchip' or 'host'")
        if self.kernel not in cost.KERNELS:
            raise ValueError(f"Techniques.kernel={self.kernel!r}: use one of {cost.KERNELS}")

    def replace(self, **changes: Any) -> Techniques:
        return dataclasses.replace(self, **changes)


ZERO_OFFLOAD = Techniques(buckets=False, gpu_tail=False, stv=False, casting="host",
                          adaptive_weights=False, kernel="deepspeed")
"""ZeRO-Offload (Ren et al. 2021) as the paper describes it: step after backward, whole-model
transfers of bf16, casts on the CPU, DeepSpeed's CPUAdam, weights stay on the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """The concrete schedule one simulation runs (every 'auto' decided)."""

    schedule: str
    bucket_bytes: int
    """Bytes of fp32 gradient per bucket (4 B/param), as OffloadConfig.bucket_bytes."""
    whole_model_bucket: bool
    ratio: float
    speculate: bool
    rollback_rate: float
    grad_cast: str
    param_cast: str
    weights: str
    kernel: cost.Kernel
    threads: int
    prefetch_depth: int
    snapshot_rollback: bool
    reasons: tuple[str, ...] = ()


def resolve(shape: ModelShape, prof: HardwareProfile, schedule: str,
            config: OffloadConfig | None, techniques: Techniques | None) -> Resolved:
    """Turn (schedule, config, techniques) into a Resolved schedule; 'auto' fields ask the cost
    model. `schedule="zero-offload"` ignores `techniques`; "gpu" keeps everything on the device."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    cfg = (config or OffloadConfig()).validate()
    tech = techniques or Techniques()
    if schedule == "zero-offload":
        tech = ZERO_OFFLOAD.replace(rollback_rate=tech.rollback_rate)
    threads = cost.cpu_threads(prof, cfg.cpu_threads, cfg.cpu_cores_frac)
    reasons: list[str] = []
    bucket_params = cfg.bucket_bytes / 4
    if tech.casting == "host":
        grad_cast, param_cast = "host", "host"
    else:
        g_auto, p_auto, why = cost.choose_casting(prof, tech.kernel, threads, bucket_params)
        grad_cast = g_auto if cfg.grad_cast == "auto" else cfg.grad_cast
        param_cast = p_auto if cfg.param_cast == "auto" else cfg.param_cast
        if "auto" in (cfg.grad_cast, cfg.param_cast):
            reasons.append(why)
    weights = "stationary"
    if tech.adaptive_weights and schedule == "superoffload":
        if cfg.weights == "auto":
            # the same rule the engine applies (plan/weights.py), so a simulated "auto" and a
            # running engine choose alike; imported here because it simulates both policies
            from superoffload.plan.weights import choose_weights

            choice = choose_weights(shape, prof, cfg)
            weights = choice.policy
            reasons.append(choice.reason)
        else:
            weights = cfg.weights
    if weights == "flow" and shape.dp > 1:
        # the ZeRO engine keeps weights stationary (distributed/zero.py: no weight-flow yet)
        weights = "stationary"
        reasons.append("data parallel: weights stay on the device (ZeRO engine has no weight-flow)")
    if weights == "flow" and param_cast != "host":
        # weight-flow streams the host's bf16 copy, so the CPU kernel must write it (§4.5)
        param_cast = "host"
        reasons.append("weight-flow: weights are cast on the host (the bf16 copy streams in)")
    if cfg.speculation == "adaptive":
        speculate = tech.stv and tech.rollback_rate < cfg.adaptive_threshold
    else:
        speculate = tech.stv and cfg.speculation == "on"
    ratio = cfg.ratio if tech.gpu_tail else 1.0
    if schedule == "gpu":
        ratio, speculate = 0.0, False
    return Resolved(
        schedule=schedule,
        bucket_bytes=int(cfg.bucket_bytes),
        whole_model_bucket=not tech.buckets,
        ratio=float(ratio),
        speculate=bool(speculate),
        rollback_rate=tech.rollback_rate,
        grad_cast=grad_cast,
        param_cast=param_cast,
        weights=weights,
        kernel=tech.kernel,
        threads=threads,
        prefetch_depth=cfg.prefetch_depth,
        snapshot_rollback=cfg.rollback == "snapshot",
        reasons=tuple(reasons),
    )
