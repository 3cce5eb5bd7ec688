"""CPU Adam/AdamW kernels: the compiled CFFI module when built, else a pure-torch fallback.

Public API (DESIGN.md §4):
    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
              weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
              param_lp=None, threads=None)
    adam_rollback(...same arguments...)
    adam_step_multi / adam_rollback_multi (lists of tensors, one parallel region)
    grad_stats(grad) -> (sum_sq, nonfinite); grad_stats_multi(grads)
    simd_path() -> str
"""

from __future__ import annotations

from superoffload.kernels import torch_ref as _impl

_BACKEND = "torch"


def adam_step(param, grad, exp_avg, exp_avg_sq, *, param_lp=None, **kw) -> None:
    _impl.adam_step_multi([param], [grad], [exp_avg], [exp_avg_sq],
                          params_lp=None if param_lp is None else [param_lp], **kw)


def adam_rollback(param, grad, exp_avg, exp_avg_sq, *, param_lp=None, **kw) -> None:
    _impl.adam_rollback_multi([param], [grad], [exp_avg], [exp_avg_sq],
                              params_lp=None if param_lp is None else [param_lp], **kw)


adam_step_multi = _impl.adam_step_multi
adam_rollback_multi = _impl.adam_rollback_multi
grad_stats_multi = _impl.grad_stats_multi


def grad_stats(grad) -> tuple[float, int]:
    return _impl.grad_stats_multi([grad])


def simd_path() -> str:
    return _impl.SIMD_PATH


def backend() -> str:
    return _BACKEND
