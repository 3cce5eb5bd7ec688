"""Superchip-aware casting, per direction (paper §4.4).

For a low-precision (bf16/fp16) model the fp32 master lives on the host, so each direction
chooses where the fp32<->bf16 cast happens:

* gradients (D2H): "device" casts on the device and moves fp32 (4 B/param; the fast link
  of a Superchip makes the extra bytes cheap and the GPU cast is nearly free); "host" moves
  bf16 (2 B/param) and the CPU kernel casts inside its single pass (better on PCIe).
* weights (H2D): "host" writes the bf16 copy in the kernel's pass and moves bf16; "device"
  moves fp32 and casts on the device.

"auto" resolves here: on a CPU-only machine the "link" is a memory copy, so moving fewer
bytes wins ("host" both ways); on CUDA the Superchip default is to cast gradients on the
device and weights on the host (the kernel writes the bf16 copy for free in its pass).
An fp32 model casts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CastPolicy:
    grad_on_host: bool
    """True: gradients cross the link in the model dtype and are cast by the CPU kernel."""
    param_on_host: bool
    """True: the CPU kernel writes the low-precision copy; it crosses the link as is."""
    model_dtype: torch.dtype

    @property
    def grad_host_dtype(self) -> torch.dtype:
        return self.model_dtype if self.grad_on_host else torch.float32

    @property
    def low_precision(self) -> bool:
        return self.model_dtype != torch.float32


def resolve_casting(
    grad_cast: str, param_cast: str, *, model_dtype: torch.dtype, device_type: str
) -> CastPolicy:
    if model_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"trainable parameters have dtype {model_dtype}; use float32, bfloat16 or float16"
        )
    if model_dtype == torch.float32:
        return CastPolicy(False, False, model_dtype)
    on_cpu = device_type == "cpu"
    grad_host = grad_cast == "host" or (grad_cast == "auto" and on_cpu)
    # The CPU kernel reads fp32 or bf16 gradients: fp16 ones are widened on the device.
    grad_host = grad_host and model_dtype == torch.bfloat16
    param_host = param_cast == "host" or param_cast == "auto"
    return CastPolicy(grad_host, param_host, model_dtype)
