"""The tuner's pure core: settings in, the planner's prediction and the engine changes out.

No widgets here: `OffloadTuner` (tuner.py) is a view that calls these on every control
change. The numbers all come from `superoffload.plan.simulate` (DESIGN.md §5).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from superoffload.config import OffloadConfig

TUNED_FIELDS: tuple[str, ...] = (
    "ratio", "bucket_bytes", "grad_cast", "param_cast", "weights", "speculation", "cpu_threads",
)
"""OffloadConfig fields the tuner's controls set."""

DEFAULT_RECONFIGURABLE: frozenset[str] = frozenset(
    {"ratio", "bucket_bytes", "speculation", "grad_cast", "param_cast", "cpu_threads", "max_grad_norm"}
)
"""What `engine.reconfigure(...)` takes between iterations when the engine's module does not
say (the engine module's own `RECONFIGURABLE` wins: see `reconfigurable_fields`)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Prediction:
    """The planner's verdict on one setting."""

    iteration_s: float
    tflops: float
    device_bytes: float | None
    host_bytes: float | None
    baseline_s: float | None
    """ZeRO-Offload on the same model and machine (None when not simulated)."""
    fits: bool | None
    """Whether both memories hold the state (None when the planner does not say)."""

    @property
    def speedup_vs_baseline(self) -> float | None:
        if self.baseline_s is None or self.iteration_s <= 0:
            return None
        return self.baseline_s / self.iteration_s


def predict(shape: Any, profile: Any, config: OffloadConfig, *, baseline_s: float | None = None) -> Prediction:
    """Simulate one SuperOffload iteration of `shape` on `profile` with `config`."""
    from superoffload import plan

    res = plan.simulate(shape, profile, schedule="superoffload", config=config)
    device, host = memory_bytes(res.memory)
    return Prediction(
        iteration_s=float(res.iteration_s),
        tflops=float(res.tflops),
        device_bytes=device,
        host_bytes=host,
        baseline_s=baseline_s,
        fits=_fits(res),
    )


def baseline_iteration_s(shape: Any, profile: Any) -> float | None:
    """The ZeRO-Offload schedule's iteration time, the paper's point of comparison."""
    from superoffload import plan

    try:
        return float(plan.simulate(shape, profile, schedule="zero-offload", config=None).iteration_s)
    except ValueError:  # the baseline may not fit where ours does
        return None


def memory_bytes(memory: Any) -> tuple[float | None, float | None]:
    """(device, host) bytes from a simulation's memory report."""
    device = _number(memory, ("device_bytes", "device_total_bytes", "device"))
    host = _number(memory, ("host_bytes", "host_total_bytes", "host"))
    return device, host


def _number(obj: Any, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _fits(res: Any) -> bool | None:
    for owner in (res, getattr(res, "memory", None)):
        value = getattr(owner, "fits", None)
        if isinstance(value, bool):
            return value
    return None


def reconfigurable_fields(engine: Any) -> frozenset[str]:
    """The fields this engine accepts in `reconfigure`: its module's `RECONFIGURABLE` set."""
    module = sys.modules.get(type(engine).__module__)
    declared = getattr(module, "RECONFIGURABLE", None)
    return frozenset(declared) if declared else DEFAULT_RECONFIGURABLE


def engine_changes(
    current: OffloadConfig, wanted: OffloadConfig, allowed: frozenset[str] = DEFAULT_RECONFIGURABLE
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(changes `engine.reconfigure` takes, changes that need a restart) among the tuned
    fields whose value differs."""
    diff = {n: getattr(wanted, n) for n in TUNED_FIELDS if getattr(wanted, n) != getattr(current, n)}
    live = {n: v for n, v in diff.items() if n in allowed}
    restart = {n: v for n, v in diff.items() if n not in allowed}
    return live, restart


def bucket_options(current_bytes: int) -> list[tuple[str, int]]:
    """Powers of two from 4 KiB to 1 GiB (plus the current value), labelled for a slider."""
    sizes = sorted({1 << k for k in range(12, 31)} | {int(current_bytes)})
    return [(format_bytes(s), s) for s in sizes]


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def prediction_text(pred: Prediction) -> str:
    """One line: predicted iteration time, TFLOPS, memory each side, speed-up vs ZeRO-Offload."""
    parts = [f"predicted iteration {_format_seconds(pred.iteration_s)}", f"{pred.tflops:.1f} TFLOPS"]
    if pred.device_bytes is not None:
        parts.append(f"device {_format_gb(pred.device_bytes)}")
    if pred.host_bytes is not None:
        parts.append(f"host {_format_gb(pred.host_bytes)}")
    speedup = pred.speedup_vs_baseline
    if speedup is not None:
        parts.append(f"{speedup:.2f}x vs ZeRO-Offload")
    if pred.fits is False:
        parts.append("DOES NOT FIT")
    return " · ".join(parts)


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _format_gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
