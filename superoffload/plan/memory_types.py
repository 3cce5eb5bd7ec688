"""The planner's memory result type (plan/memory.py computes it; plan/deepspeed.py too, for
DeepSpeed's own buffers — a leaf module, so neither imports the other to share it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes on each side and what they hold."""

    device: float
    host: float
    device_parts: dict[str, float]
    host_parts: dict[str, float]

    def as_dict(self) -> dict[str, float]:
        return {"device": self.device, "host": self.host}
