"""Pure-torch reference/fallback of the CPU Adam kernel (same signatures as the C path).

Used when the compiled module is missing, and as a readable statement of the maths
(DESIGN.md §4). All arithmetic in float32, elementwise, in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SIMD_PATH = "torch"


def _coefficients(step: int, lr: float, beta1: float, beta2: float, bias_correction: bool):
    if bias_correction:
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
    else:
        bc1 = bc2 = 1.0
    return lr / bc1, math.sqrt(bc2)


def _step_one(p, g_in, m, v, p_lp, *, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
              bias_correction, grad_scale):
    g = g_in.float() * grad_scale if (g_in.dtype != torch.float32 or grad_scale != 1.0) else g_in
    if not adamw_mode and weight_decay != 0.0:
        g = g + weight_decay * p
    m32 = m.float()
    v32 = v.float()
    m32.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size, bc2_sqrt = _coefficients(step, lr, beta1, beta2, bias_correction)
    if adamw_mode and weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    denom = (v32.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m32, denom, value=-step_size)
    if m.dtype != torch.float32:
        m.copy_(m32)
        v.copy_(v32)
    if p_lp is not None:
        p_lp.copy_(p)


def _rollback_one(p, g_in, m, v, p_lp, *, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                  bias_correction, grad_scale):
    for name, t in (("param", p), ("exp_avg", m), ("exp_avg_sq", v)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"adam_rollback: {name} holds non-finite values; cannot invert the step")
    g = g_in.float() * grad_scale
    m32 = m.float()
    v32 = v.float()
    step_size, bc2_sqrt = _coefficients(step, lr, beta1, beta2, bias_correction)
    denom = (v32.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m32, denom, value=step_size)
    if adamw_mode and weight_decay != 0.0:
        p.div_(1.0 - lr * weight_decay)
    if not adamw_mode and weight_decay != 0.0:
        g = g + weight_decay * p
    m32.sub_(g, alpha=1.0 - beta1).div_(beta1)
    v32.addcmul_(g, g, value=-(1.0 - beta2)).div_(beta2).clamp_(min=0.0)
    m.copy_(m32)
    v.copy_(v32)
    if p_lp is not None:
        p_lp.copy_(p)


def adam_step_multi(params: Sequence[torch.Tensor], grads, exp_avgs, exp_avg_sqs, *, step, lr,
                    beta1, beta2, eps, weight_decay=0.0, adamw_mode=True, bias_correction=True,
                    grad_scale=1.0, params_lp=None, threads=None, sr_seed=0) -> None:
    lps = params_lp if params_lp is not None else [None] * len(params)
    with torch.no_grad():
        for p, g, m, v, lp in zip(params, grads, exp_avgs, exp_avg_sqs, lps):
            _step_one(p, g, m, v, lp, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, adamw_mode=adamw_mode,
                      bias_correction=bias_correction, grad_scale=grad_scale)


def adam_rollback_multi(params: Sequence[torch.Tensor], grads, exp_avgs, exp_avg_sqs, *, step, lr,
                        beta1, beta2, eps, weight_decay=0.0, adamw_mode=True, bias_correction=True,
                        grad_scale=1.0, params_lp=None, threads=None, sr_seed=0) -> None:
    lps = params_lp if params_lp is not None else [None] * len(params)
    with torch.no_grad():
        for p, g, m, v, lp in zip(params, grads, exp_avgs, exp_avg_sqs, lps):
            _rollback_one(p, g, m, v, lp, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, adamw_mode=adamw_mode,
                          bias_correction=bias_correction, grad_scale=grad_scale)


def grad_stats_multi(grads: Sequence[torch.Tensor]) -> tuple[float, int]:
    sum_sq = 0.0
    nonfinite = 0
    for g in grads:
        g64 = g.detach().double()
        finite = torch.isfinite(g64)
        nonfinite += int((~finite).sum())
        sum_sq += float(torch.where(finite, g64, 0.0).square().sum())
    return sum_sq, nonfinite
