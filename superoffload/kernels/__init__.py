"""CPU Adam/AdamW kernels: the compiled CFFI module when built, else a pure-torch fallback.

Public API (DESIGN.md §4, issue 2; docs/kernel.md):
    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
              weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
              param_lp=None, threads=None, sr_seed=0)         # in place
    adam_rollback(...same arguments...)                       # undoes that step, in place
    adam_step_multi / adam_rollback_multi(params, grads, exp_avgs, exp_avg_sqs, *, ...,
              params_lp=None, ...)                            # lists, ONE parallel region
    grad_stats(grad) -> (sum_sq, nonfinite); grad_stats_multi(grads)
    simd_path() -> "avx512" | "avx2" | "portable" | "neon" | "sve" | "torch"
    backend() -> "cffi" | "torch"

SUPEROFFLOAD_KERNEL=torch forces the fallback (read at import); a missing build falls back
with one warning; a stale build (ABI version mismatch) raises ImportError.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

KERNEL_ENV = "SUPEROFFLOAD_KERNEL"


def _load_backend() -> tuple[ModuleType, str]:
    from superoffload.kernels import torch_ref

    if os.environ.get(KERNEL_ENV, "").strip().lower() == "torch":
        return torch_ref, "torch"
    try:
        from superoffload.kernels import cpu_adam
    except ImportError as exc:
        if isinstance(exc.__cause__, ModuleNotFoundError) or "not built" in str(exc):
            warnings.warn(f"{exc}. Using the pure-torch fallback (slower).",
                          RuntimeWarning, stacklevel=3)
            return torch_ref, "torch"
        raise  # a stale build fails loudly
    return cpu_adam, "cffi"


_impl, _BACKEND = _load_backend()


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float = 0.0, adamw_mode: bool = True,
              bias_correction: bool = True, grad_scale: float = 1.0,
              param_lp: torch.Tensor | None = None, threads: int | None = None,
              sr_seed: int = 0) -> None:
    """One Adam(W) step over one tensor, in place (param, exp_avg, exp_avg_sq, param_lp)."""
    _impl.adam_step_multi([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                          beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          adamw_mode=adamw_mode, bias_correction=bias_correction,
                          grad_scale=grad_scale, params_lp=None if param_lp is None else [param_lp],
                          threads=threads, sr_seed=sr_seed)


def adam_rollback(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float = 0.0, adamw_mode: bool = True,
                  bias_correction: bool = True, grad_scale: float = 1.0,
                  param_lp: torch.Tensor | None = None, threads: int | None = None,
                  sr_seed: int = 0) -> None:
    """Undo adam_step with the same arguments (DESIGN.md §4), in place."""
    _impl.adam_rollback_multi([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                              adamw_mode=adamw_mode, bias_correction=bias_correction,
                              grad_scale=grad_scale,
                              params_lp=None if param_lp is None else [param_lp],
                              threads=threads, sr_seed=sr_seed)


adam_step_multi = _impl.adam_step_multi
adam_rollback_multi = _impl.adam_rollback_multi

from superoffload.kernels.device_adam import device_adam_multi  # noqa: E402
from superoffload.kernels.hyper import AdamHyper  # noqa: E402


def grad_stats_multi(grads: list[torch.Tensor], threads: int | None = None) -> tuple[float, int]:
    """(sum of squares of the finite values in fp64, count of non-finite values)."""
    return _impl.grad_stats_multi(grads, threads)  # type: ignore[no-any-return]


def grad_stats(grad: torch.Tensor, threads: int | None = None) -> tuple[float, int]:
    return grad_stats_multi([grad], threads)


def simd_path() -> str:
    """The SIMD path that runs: avx512, avx2, portable, neon, sve, or torch (fallback)."""
    return "torch" if _BACKEND == "torch" else _impl.simd_path()  # type: ignore[no-any-return]


def backend() -> str:
    """"cffi" (compiled kernel) or "torch" (fallback)."""
    return _BACKEND


__all__ = ["AdamHyper", "adam_rollback", "adam_rollback_multi", "adam_step", "adam_step_multi",
           "backend", "device_adam_multi",
           "grad_stats", "grad_stats_multi", "simd_path"]
