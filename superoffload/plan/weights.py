"""The weight-policy choice: weight-stationary or weight-flow (paper §4.5). Pure.

A pure function of (model shape, hardware profile, config, device-memory cap): it asks the
planner's simulator (plan/simulate.py) for both policies and the cost model for the
weight-flow efficiency ``compute / (compute + exposed transfer)`` (plan/cost.py). Compute
grows with micro-batch x sequence x parameters, a block's fetch only with its parameters,
so long sequences hide the fetch and their activations crowd device memory. The rule:

1. only one policy fits device memory -> that one (stationary keeps every bf16 weight and
   gradient resident; flow keeps ``prefetch_depth + 1`` blocks);
2. neither fits -> flow, the smaller of the two, with the shortfall in the reason;
3. both fit -> flow when its transfer is hidden (efficiency >= ``FLOW_MIN_EFFICIENCY``, the
   planner's own threshold) *and* activations dominate device memory (they exceed the
   resident bf16 weights + gradients of stationary); stationary otherwise (same speed, no
   per-block traffic, nothing to go wrong).

The engine's ``weights="auto"`` calls this (runtime/weights.py), and so does the planner's
``techniques.resolve`` for a simulated "auto"; what weight-flow implies (every bucket
offloaded, weights cast on the host, also under data parallel) is the rule book's
(plan/schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.plan import cost
from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulate import SimResult, simulate

FLOW_MIN_EFFICIENCY = 0.98
"""Weight-flow counts as free when at most 2% of its compute is exposed transfer."""


@dataclass(frozen=True, slots=True)
class WeightChoice:
    """The choice, the planner's numbers behind it and a one-paragraph reason."""

    policy: str
    """"stationary" or "flow"."""
    reason: str
    efficiency: float
    """Predicted weight-flow efficiency compute / (compute + exposed fetch)."""
    stationary_s: float
    flow_s: float
    """Predicted iteration seconds of each policy."""
    stationary_device_bytes: float
    flow_device_bytes: float
    activation_bytes: float
    device_memory_bytes: float
    """The device memory the choice was made for (profile, or the cap)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def choose_weights(shape: ModelShape, prof: HardwareProfile, config: OffloadConfig | None = None,
                   *, device_memory_bytes: float | None = None) -> WeightChoice:
    """Pick the weight policy for ``shape`` on ``prof`` (see the module docstring)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"choose_weights: shape must be a ModelShape, got {type(shape).__name__}")
    if device_memory_bytes is not None:
        if device_memory_bytes <= 0:
            raise ValueError(f"device_memory_bytes={device_memory_bytes}: use a positive byte count")
        prof = prof.replace(device_memory_bytes=float(device_memory_bytes))
    base = (config or OffloadConfig()).replace(weights="stationary", extra={})
    stat: SimResult = simulate(shape, prof, "superoffload", base)
    # the rule book runs weight-flow with every bucket on the host, weights cast on the host
    flow: SimResult = simulate(shape, prof, "superoffload", base.replace(weights="flow"))
    eff = cost.weight_flow_efficiency(shape, prof)
    act = shape.activation_bytes()
    parts = stat.memory_detail.device_parts
    resident = parts.get("weights_bf16", 0.0) + parts.get("grads_bf16", 0.0)
    numbers = (f"predicted {stat.iteration_s * 1e3:.3g} ms (stationary) vs "
               f"{flow.iteration_s * 1e3:.3g} ms (flow); device memory "
               f"{_gb(stat.memory['device'])} vs {_gb(flow.memory['device'])} of "
               f"{_gb(prof.device_memory_bytes)}; activations {_gb(act)}; weight-flow "
               f"efficiency {eff:.3f}")
    if stat.fits and not flow.fits:
        policy, why = "stationary", "weight-flow does not fit: " + "; ".join(flow.problems)
    elif flow.fits and not stat.fits:
        policy, why = "flow", "weight-stationary does not fit: " + "; ".join(stat.problems)
    elif not flow.fits:
        policy, why = "flow", ("neither policy fits; weight-flow needs the least device memory: "
                               + "; ".join(flow.problems))
    elif eff >= FLOW_MIN_EFFICIENCY and act > resident:
        policy, why = "flow", (f"both fit; the fetch hides behind compute (efficiency {eff:.3f} >= "
                               f"{FLOW_MIN_EFFICIENCY}) and activations ({_gb(act)}) outweigh the "
                               f"resident weights + gradients ({_gb(resident)})")
    else:
        cause = (f"efficiency {eff:.3f} < {FLOW_MIN_EFFICIENCY}" if eff < FLOW_MIN_EFFICIENCY
                 else f"activations ({_gb(act)}) do not outweigh the resident weights + "
                      f"gradients ({_gb(resident)})")
        policy, why = "stationary", f"both fit and weight-flow would gain nothing: {cause}"
    return WeightChoice(
        policy=policy, reason=f"weights={policy}: {why}; {numbers}", efficiency=eff,
        stationary_s=stat.iteration_s, flow_s=flow.iteration_s,
        stationary_device_bytes=stat.memory["device"], flow_device_bytes=flow.memory["device"],
        activation_bytes=act, device_memory_bytes=prof.device_memory_bytes,
    )
