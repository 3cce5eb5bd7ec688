"""The planner's memory result type (plan/memory.py computes it; plan/deepspeed.py too, for
DeepSpeed's own buffers — a leaf module, so neither imports the other to share it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes on each side and what they hold. ``device`` is the peak over one iteration and
    ``device_parts`` what the device holds at that moment (they sum to it)."""

    device: float
    host: float
    device_parts: dict[str, float]
    host_parts: dict[str, float]
    device_kept: float | None = None
    """The device peak of what tensors keep (the engine's buffers, weights, gradients, what
    autograd saves): ``device`` less the allocator's transients (the loss's gradients at the
    start of backward, the tail step's temporaries). What a meter of live tensors such as
    ``runtime.device_meter.DeviceMeter`` counts; None: not modelled (``device``)."""

    storage: float = 0.0
    """Bytes in the storage tier's files (0 without a tier): the optimizer state's two
    versions and gradients (plan/storage.py) and weights kept there."""
    storage_parts: dict[str, float] = field(default_factory=dict)
    refusal: str = ""
    """Why the engine would refuse the setting when it starts (a host memory budget that
    cannot hold what must stay in memory); ``check_fits`` reports it."""

    def as_dict(self) -> dict[str, float]:
        return {"device": self.device, "host": self.host, "storage": self.storage}
