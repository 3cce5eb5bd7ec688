"""The weight-policy choice: weight-stationary or weight-flow (paper §4.5). Pure.

A pure function of (model shape, hardware profile, config, device-memory cap): it asks the
planner's simulator (plan/simulator.py) for both policies and the cost model for the
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

The engine's ``weights="auto"`` calls this (runtime/weight_policy.py), and so does the planner's
``techniques.resolve`` for a simulated "auto"; what weight-flow implies (every bucket
offloaded, weights cast on the host, also under data parallel) is the rule book's
(plan/schedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def fmt_gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"
