"""Ablation: how much each SuperOffload technique contributes (paper §6 style).

Two views, both simulated:
  cumulative    start from ZeRO-Offload and switch techniques on one at a time, in the order
                the paper introduces them (kernel, buckets, STV, GPU tail, casting, weights);
  leave-one-out full SuperOffload with one technique switched off: the slowdown is what that
                technique is worth given all the others (interactions included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulator import simulate
from superoffload.plan.techniques import ZERO_OFFLOAD, Techniques

# (label, the switch that turns the technique on, the switch that turns it off)
STEPS: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
    ("GraceAdam-class kernel (§4.6)", {"kernel": "ours"}, {"kernel": "deepspeed"}),
    ("bucketization (§4.2)", {"buckets": True}, {"buckets": False}),
    ("STV (§4.3)", {"stv": True}, {"stv": False}),
    ("GPU tail buckets (§4.2)", {"gpu_tail": True}, {"gpu_tail": False}),
    ("Superchip-aware casting (§4.4)", {"casting": "superchip"}, {"casting": "host"}),
    ("adaptive weights (§4.5)", {"adaptive_weights": True}, {"adaptive_weights": False}),
)


@dataclass(frozen=True, slots=True)
class AblationRow:
    technique: str
    cumulative_s: float
    """Iteration time with this and every earlier technique on (ZeRO-Offload otherwise)."""
    speedup_vs_zero: float
    """ZeRO-Offload time / cumulative_s."""
    without_s: float
    """Iteration time of full SuperOffload without only this technique."""
    worth: float
    """without_s / full SuperOffload time - 1: the slowdown when it is removed."""


@dataclass(frozen=True, slots=True)
class Ablation:
    zero_offload_s: float
    superoffload_s: float
    rows: tuple[AblationRow, ...]

    @property
    def speedup(self) -> float:
        return self.zero_offload_s / self.superoffload_s

    def table(self) -> str:
        head = f"{'technique':34} {'cumulative':>11} {'vs ZeRO':>8} {'without it':>11} {'worth':>7}"
        lines = [head, "-" * len(head),
                 f"{'ZeRO-Offload baseline':34} {self.zero_offload_s * 1e3:9.1f}ms {1.0:7.2f}x"]
        for r in self.rows:
            lines.append(f"{r.technique:34} {r.cumulative_s * 1e3:9.1f}ms {r.speedup_vs_zero:7.2f}x"
                         f" {r.without_s * 1e3:9.1f}ms {r.worth:+7.1%}")
        lines.append(f"{'SuperOffload (all)':34} {self.superoffload_s * 1e3:9.1f}ms "
                     f"{self.speedup:7.2f}x")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"zero_offload_s": self.zero_offload_s, "superoffload_s": self.superoffload_s,
                "speedup": self.speedup,
                "rows": [{"technique": r.technique, "cumulative_s": r.cumulative_s,
                          "speedup_vs_zero": r.speedup_vs_zero, "without_s": r.without_s,
                          "worth": r.worth} for r in self.rows]}


def ablation(shape: ModelShape, prof: HardwareProfile, config: OffloadConfig | None = None,
             rollback_rate: float | None = None) -> Ablation:
    """Simulate the two ablation views for `shape` on `prof` (config: SuperOffload's settings)."""
    full_t = Techniques()
    if rollback_rate is not None:
        # otherwise Techniques' own default clipping rate
        full_t = Techniques(rollback_rate=rollback_rate)
    zero = simulate(shape, prof, "zero-offload", config, full_t).iteration_s
    full = simulate(shape, prof, "superoffload", config, full_t).iteration_s
    rows = []
    tech = ZERO_OFFLOAD.replace(rollback_rate=full_t.rollback_rate)
    for label, on, off in STEPS:
        tech = tech.replace(**on)
        cum = simulate(shape, prof, "superoffload", config, tech).iteration_s
        without = simulate(shape, prof, "superoffload", config, full_t.replace(**off)).iteration_s
        rows.append(AblationRow(label, cum, zero / cum, without, without / full - 1))
    return Ablation(zero, full, tuple(rows))
