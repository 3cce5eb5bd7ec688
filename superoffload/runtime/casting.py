"""Superchip-aware casting, per direction (paper §4.4).

For a low-precision (bf16/fp16) model the fp32 master lives on the host, so each direction
chooses where the fp32<->bf16 cast happens:

* gradients (D2H): "device" casts on the device and moves fp32 (4 B/param; the fast link
  of a Superchip makes the extra bytes cheap and the GPU cast is nearly free); "host" moves
  bf16 (2 B/param) and the CPU kernel casts inside its single pass (better on PCIe).
* weights (H2D): "host" writes the bf16 copy in the kernel's pass and moves bf16; "device"
  moves fp32 and casts on the device.

"auto" is resolved by the rule book (``plan.schedule.resolve_casting``, shared with the
planner): on a CPU-only machine the "link" is a memory copy, so moving fewer bytes wins
("host" both ways); on a GPU the cost model picks for the engine's hardware profile. An
fp32 model casts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from superoffload.plan.schedule import Schedule


@dataclass(frozen=True, slots=True)
class CastPolicy:
    grad_on_host: bool
    """True: gradients cross the link in the model dtype and are cast by the CPU kernel."""
    param_on_host: bool
    """True: the CPU kernel writes the low-precision copy; it crosses the link as is."""
    model_dtype: torch.dtype
    accum_on_host: bool = False
    """Gradients accumulate on the host (``OffloadConfig.grad_accum_on="host"``): the host
    buffer holds an fp32 sum whatever dtype crosses (a bf16 sum would round every add)."""

    @property
    def grad_host_dtype(self) -> torch.dtype:
        # cast by the CPU kernel: the gradient lands in the model dtype; a host sum is fp32
        # whatever crosses, and a cast on the device sends fp32
        if self.grad_on_host and not self.accum_on_host:
            return self.model_dtype
        return torch.float32

    @property
    def low_precision(self) -> bool:
        return self.model_dtype != torch.float32


def cast_policy(schedule: Schedule, model_dtype: torch.dtype, *,
                accum_on_host: bool = False) -> CastPolicy:
    """The casting the schedule decided (``plan.schedule.resolve_casting``), for the buffers;
    ``accum_on_host``: gradients accumulate on the host (fp32 host buffers)."""
    low = model_dtype != torch.float32
    return CastPolicy(low and schedule.grad_cast == "host", low and schedule.param_cast == "host",
                      model_dtype, accum_on_host)
