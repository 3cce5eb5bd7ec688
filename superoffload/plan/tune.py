"""Auto-tuner: search OffloadConfig settings with the simulator and explain the choice.

Coordinate descent over the knobs the paper tunes by hand (§4.2 bucket size and ratio, §4.3 STV
mode, §4.4 casting side, §4.5 weight policy, the CPU core split): start from the paper's
defaults, improve one knob at a time by simulated expected iteration time among the settings
that fit memory, until nothing changes. Every candidate is a `simulate()` call (milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from superoffload.config import MiB, OffloadConfig
from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.schedule import EngineVariant
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulate import SimResult, simulate
from superoffload.plan.techniques import PAPER_CLIP_RATE, Techniques

BUCKET_CHOICES = tuple(m * MiB for m in (8, 16, 32, 64, 128, 256, 512))
TIE = 0.002
"""Relative difference in predicted time below which two settings count as equally fast."""
RATIO_CHOICES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


class InfeasibleError(ValueError):
    """No setting fits: the message says what is needed and what the profile has."""


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Limits and fixed choices for `tune`. Memory caps tighten the profile's figures."""

    device_memory_bytes: float | None = None
    host_memory_bytes: float | None = None
    cpu_cores: int | None = None
    """Cores the training job may use on the host (default: all of the profile's)."""
    rollback_rate: float = PAPER_CLIP_RATE
    """Expected share of iterations that clip or overflow (paper: 93 of ~79,000 for BLOOM)."""
    max_grad_norm: float | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    """OffloadConfig fields to keep as given, e.g. {"ratio": 0.9, "weights": "stationary"}."""
    bucket_choices: tuple[int, ...] = BUCKET_CHOICES
    ratio_choices: tuple[float, ...] = RATIO_CHOICES
    engine: EngineVariant | None = None
    """The engine variant to tune for; None: the one the engine implements (schedule.ENGINE)."""

    def apply(self, prof: HardwareProfile) -> HardwareProfile:
        changes: dict[str, Any] = {}
        if self.device_memory_bytes is not None:
            changes["device_memory_bytes"] = min(prof.device_memory_bytes, self.device_memory_bytes)
        if self.host_memory_bytes is not None:
            changes["host_memory_bytes"] = min(prof.host_memory_bytes, self.host_memory_bytes)
        if self.cpu_cores is not None:
            if self.cpu_cores < 1:
                raise ValueError(f"Constraints.cpu_cores={self.cpu_cores}: use a whole number >= 1")
            changes["cpu_cores"] = min(prof.cpu_cores, self.cpu_cores)
        return prof.replace(**changes) if changes else prof


def _threads_frac(prof: HardwareProfile) -> list[float]:
    """Core-split candidates: leave one core to the engine's hook/transfer threads, or not."""
    n = prof.cpu_cores
    fracs = {1.0, 0.9, 0.75, 0.5}
    if n > 1:
        fracs.add((n - 1) / n)
    return sorted(fracs, reverse=True)


def tune(model_or_shape: Any, prof: HardwareProfile, constraints: Constraints | None = None, *,
         seq: int | None = None, micro_batch: int = 1
         ) -> tuple[OffloadConfig, str, SimResult]:
    """Best OffloadConfig for `model_or_shape` (ModelShape, or nn.Module with `seq`) on `prof`.
    Returns (config, explanation, prediction); raises InfeasibleError naming what does not fit."""
    shape = _as_shape(model_or_shape, seq, micro_batch)
    cons = constraints or Constraints()
    eff = cons.apply(prof)
    tech = Techniques(rollback_rate=cons.rollback_rate, engine=cons.engine)
    base = OffloadConfig(max_grad_norm=cons.max_grad_norm).replace(**cons.fixed)
    cache: dict[tuple, SimResult] = {}

    def run(cfg: OffloadConfig) -> SimResult:
        key = tuple(sorted((k, repr(v)) for k, v in cfg.to_dict().items() if k != "extra"))
        if key not in cache:
            cache[key] = simulate(shape, eff, "superoffload", cfg, tech)
        return cache[key]

    def score(r: SimResult) -> float:
        return r.iteration_s if r.fits else math.inf

    # most memory-frugal setting first: if that does not fit, nothing does
    frugal = {"ratio": 1.0, "weights": "flow", "bucket_bytes": min(cons.bucket_choices),
              "rollback": "inverse", "grad_cast": "host", "param_cast": "host"}
    lean = run(base.replace(**{k: v for k, v in frugal.items() if k not in cons.fixed}))
    if not lean.fits:
        raise InfeasibleError(
            f"{shape.params / 1e9:.2f}B parameters cannot be trained on {prof.name} even with "
            f"every state on the host and weights streamed: " + "; ".join(lean.problems))

    knobs: dict[str, list[Any]] = {
        "bucket_bytes": list(cons.bucket_choices),
        "ratio": list(cons.ratio_choices),
        "weights": ["stationary", "flow"],
        "grad_cast": ["device", "host"],
        "param_cast": ["host", "device"],
        "speculation": ["on", "off", "adaptive"],
        "cpu_cores_frac": _threads_frac(eff),
        "prefetch_depth": [1, 2, 3],
    }
    knobs = {k: v for k, v in knobs.items() if k not in cons.fixed}
    start = {"weights": "stationary", "grad_cast": "auto", "param_cast": "auto"}
    cfg = base.replace(**{k: v for k, v in start.items() if k not in cons.fixed})
    if not run(cfg).fits:
        cfg = base.replace(**{k: v for k, v in frugal.items() if k not in cons.fixed})
    best = run(cfg)
    tried: dict[str, list[tuple[Any, SimResult]]] = {}
    for _round in range(4):
        changed = False
        for name, choices in knobs.items():
            if name == "prefetch_depth" and cfg.weights != "flow":
                continue
            results = [(v, run(cfg.replace(**{name: v}))) for v in choices]
            tried[name] = results
            fastest = min(score(r) for _, r in results)
            if math.isinf(fastest):
                continue
            # settings within TIE of the fastest are equal: take the preferred one
            near = [(v, r) for v, r in results if score(r) <= fastest * (1 + TIE)]
            value, res = min(near, key=lambda vr: (_prefer(name, vr[0]), score(vr[1])))
            if value != getattr(cfg, name) and (score(res) < score(best) * (1 + TIE)):
                cfg, best, changed = cfg.replace(**{name: value}), res, True
        if not changed:
            break
    if not best.fits:  # pragma: no cover - the frugal start fits by the check above
        raise InfeasibleError("; ".join(best.problems))
    zero = simulate(shape, eff, "zero-offload", None, tech)
    explanation = _explain(shape, eff, cfg, best, zero, tried, cons)
    cfg = cfg.replace(extra={**cfg.extra, "planner": {
        "profile": prof.name,
        "predicted_iteration_s": float(best.iteration_s),
        "predicted_tflops": float(best.tflops),
        "predicted_memory_bytes": {k: float(v) for k, v in best.memory.items()},
        "zero_offload_iteration_s": float(zero.iteration_s) if zero.fits else None,
        "explanation": explanation,
    }})
    return cfg, explanation, best


def _prefer(name: str, value: Any) -> float:
    """Tie-break between equally fast settings: the paper's defaults, less device memory."""
    if name == "ratio":
        return -float(value)  # more offloaded = less device memory
    if name == "bucket_bytes":
        return abs(math.log2(value / (64 * MiB)))
    if name == "speculation":
        return {"on": 0, "adaptive": 1, "off": 2}[value]
    if name == "weights":
        return 0 if value == "stationary" else 1
    if name == "cpu_cores_frac":
        return float(value)  # as fast with fewer cores: leave the rest to the data pipeline
    return 0.0


def _as_shape(obj: Any, seq: int | None, micro_batch: int) -> ModelShape:
    if isinstance(obj, ModelShape):
        return obj
    if seq is None:
        raise TypeError("tune: pass a ModelShape, or an nn.Module together with seq=<tokens>")
    return ModelShape.from_module(obj, seq=seq, micro_batch=micro_batch)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _explain(shape: ModelShape, prof: HardwareProfile, cfg: OffloadConfig, best: SimResult,
             zero: SimResult, tried: dict[str, list[tuple[Any, SimResult]]],
             cons: Constraints) -> str:
    lines = [
        f"Model {shape.params / 1e9:.2f}B params ({shape.layers} layers x {shape.hidden}), "
        f"seq {shape.seq} x batch {shape.micro_batch} on {prof.name}.",
        f"Predicted: {best.iteration_s * 1e3:.1f} ms/iteration, {best.tflops:.0f} TFLOPS "
        f"(device compute busy {best.lanes['device_compute'].utilization:.0%}, CPU optimizer busy "
        f"{best.lanes['cpu_optimizer'].utilization:.0%}); device {_gb(best.memory['device'])}, "
        f"host {_gb(best.memory['host'])}.",
    ]
    if zero.fits:
        lines.append(f"ZeRO-Offload would take {zero.iteration_s * 1e3:.1f} ms: "
                     f"{zero.iteration_s / best.iteration_s:.2f}x slower.")
    else:
        lines.append("ZeRO-Offload would not fit: " + "; ".join(zero.problems) + ".")
    why = {
        "ratio": "share of gradient bytes stepped on the CPU; the rest stays on the device so the "
                 "next forward need not wait for the CPU (paper §4.2)",
        "bucket_bytes": "bucket size: small buckets pay per-transfer latency, large ones start the "
                        "CPU late and leave a longer tail (§4.2)",
        "weights": "weight policy (§4.5)",
        "grad_cast": "where gradients are cast (§4.4)",
        "param_cast": "where updated weights are cast (§4.4)",
        "speculation": f"STV mode at an expected clipping rate of {cons.rollback_rate:.4f} (§4.3)",
        "cpu_cores_frac": "share of host cores for the CPU optimizer (settings within "
                          f"{TIE:.1%} of the fastest count as equal; fewer cores win the tie, "
                          "leaving the rest to the data pipeline)",
        "prefetch_depth": "weight-flow blocks fetched ahead",
    }
    for name, results in tried.items():
        chosen = getattr(cfg, name)
        parts = []
        for value, res in results:
            if value == chosen:
                continue
            if not res.fits:
                parts.append(f"{_fmt(name, value)}: does not fit ({res.problems[0]})")
            else:
                delta = res.iteration_s / best.iteration_s - 1
                parts.append(f"{_fmt(name, value)}: {delta:+.1%}")
        shown = _fmt(name, chosen)
        lines.append(f"- {name} = {shown}: {why[name]}. Alternatives: " + ", ".join(
            parts[:4]) + ("" if len(parts) <= 4 else ", ..."))
    for key, value in sorted(cons.fixed.items()):
        lines.append(f"- {key} = {value!r}: fixed by the constraints.")
    lines.extend(f"- cost model: {r}" for r in best.plan.reasons)
    return "\n".join(lines)


def _fmt(name: str, value: Any) -> str:
    if name == "bucket_bytes":
        return f"{value // MiB} MiB"
    if isinstance(value, float):
        return f"{value:.3g}"
    return repr(value) if isinstance(value, str) else str(value)
