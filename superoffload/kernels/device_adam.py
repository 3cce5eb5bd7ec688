"""Adam(W) on the device for GPU tail buckets (paper §4.2), in torch ops.

The compiled kernel is CPU-only; a GPU tail bucket's fp32 master and moments live on the
device and are stepped there with the verdict's clip/unscale factor. Same maths and order
of operations as the CPU kernel (DESIGN.md §4, kernels/torch_ref.py); the keyword signature
is the kernels' (``adam_step_multi``), so the engine calls either through one path.
"""

from __future__ import annotations

import math

import torch


def device_adam_multi(params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                      step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, adamw_mode: bool, bias_correction: bool,
                      grad_scale: float, params_lp: list[torch.Tensor] | None,
                      threads: int | None = None) -> None:
    """One Adam(W) step over device tensors in place; ``params_lp`` receives the cast copy."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
    if not params:
        return
    # foreach ops: one launch per op over all tensors (torch.optim's foreach AdamW idea).
    g32 = [x.float() for x in grads] if grads[0].dtype != torch.float32 else list(grads)
    g = list(torch._foreach_mul(g32, grad_scale))
    if not adamw_mode and weight_decay != 0.0:
        torch._foreach_add_(g, params, alpha=weight_decay)  # Adam with L2: decay in the moments
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, g, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - beta2)
    if adamw_mode and weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bc1)
    if params_lp is not None:
        for lp, p in zip(params_lp, params):
            lp.copy_(p)
