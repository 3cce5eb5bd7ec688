"""CPU Adam/AdamW kernels: the compiled CFFI module when built, else a pure-torch fallback.

Public API (DESIGN.md §4; docs/kernel.md):
    AdamHyper(lr, beta1, beta2, eps, weight_decay, adamw_mode=True, bias_correction=True,
              maximize=False)
    AdamHyper.from_group(param_group)     # the one hyper-parameter type; torch.optim.AdamW's
                                          # flags honoured or refused (kernels/hyper.py)
    prepare_adam(params, grads, exp_avgs, exp_avg_sqs, params_lp=None) -> PreparedAdam
        .step(hyper, *, step, grad_scale=1.0, threads=None, sr_seed=0, grads=None,
              options=None)
        .rollback(hyper, *, step, grad_scale=1.0, threads=None, sr_seed=0, grads=None,
                  options=None)
    ExecOptions(schedule="static", chunk_elems=65536)    # how a call runs, never its bits
        # tensors checked and the C descriptor built ONCE; each call checks its numbers
    prepare_grad_stats(grads) -> PreparedGradStats; (threads=None) -> (sum_sq, nonfinite)
    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
              weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
              param_lp=None, threads=None, sr_seed=0, maximize=False)   # in place
    adam_rollback(...same arguments...)                       # undoes that step, in place
    adam_step_multi / adam_rollback_multi(params, grads, exp_avgs, exp_avg_sqs, *, ...,
              params_lp=None, ...)                            # lists, ONE parallel region
    grad_stats(grad) -> (sum_sq, nonfinite); grad_stats_multi(grads)
    device_adam_multi(...)                                    # the GPU tail step (torch ops)
    simd_path() -> "avx512" | "avx2" | "portable" | "neon" | "sve" | "torch"
    backend() -> "cffi" | "torch"
    wait_policy() -> WaitPolicy; openmp_library() -> path   # the process's OpenMP runtime

``threads=None`` means the one thread rule (``superoffload.threads``: the affinity mask).
SUPEROFFLOAD_KERNEL=torch forces the fallback (read at import); a missing build falls back
with one warning; a stale build (ABI version mismatch) raises ImportError.

Importing this package loads torch and the compiled module, and does nothing else: no
thread, no environment variable. The compiled kernel's first call settles the process's
OpenMP wait policy, once (it may park an OpenMP pool on a daemon thread,
``superoffload-omp-throttle``: kernels/openmp.py; docs/kernel.md, "Threads, the work split
and the OpenMP wait policy").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch

from superoffload.kernels.openmp import openmp_library, wait_policy

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
        # a stale build fails loudly
        raise
    return cpu_adam, "cffi"


_impl, _BACKEND = _load_backend()


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float = 0.0, adamw_mode: bool = True,
              bias_correction: bool = True, grad_scale: float = 1.0,
              param_lp: torch.Tensor | None = None, threads: int | None = None,
              sr_seed: int = 0, maximize: bool = False) -> None:
    """One Adam(W) step over one tensor, in place (param, exp_avg, exp_avg_sq, param_lp)."""
    _impl.adam_step_multi([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                          beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          adamw_mode=adamw_mode, bias_correction=bias_correction,
                          grad_scale=grad_scale, params_lp=None if param_lp is None else [param_lp],
                          threads=threads, sr_seed=sr_seed, maximize=maximize)


def adam_rollback(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float = 0.0, adamw_mode: bool = True,
                  bias_correction: bool = True, grad_scale: float = 1.0,
                  param_lp: torch.Tensor | None = None, threads: int | None = None,
                  sr_seed: int = 0, maximize: bool = False) -> None:
    """Undo adam_step with the same arguments (DESIGN.md §4), in place."""
    _impl.adam_rollback_multi([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                              adamw_mode=adamw_mode, bias_correction=bias_correction,
                              grad_scale=grad_scale,
                              params_lp=None if param_lp is None else [param_lp],
                              threads=threads, sr_seed=sr_seed, maximize=maximize)


adam_step_multi = _impl.adam_step_multi
adam_rollback_multi = _impl.adam_rollback_multi

from superoffload.kernels.checks import ExecOptions  # noqa: E402
from superoffload.kernels.device_adam import device_adam_multi  # noqa: E402
from superoffload.kernels.hyper import AdamHyper  # noqa: E402
from superoffload.kernels.prepared import (  # noqa: E402
    PreparedAdam,
    PreparedGradStats,
    StalePreparedCall,
    prepare,
)


def prepare_adam(params: list[torch.Tensor], grads: list[torch.Tensor] | None,
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 params_lp: Sequence[torch.Tensor | None] | None = None) -> PreparedAdam:
    """Validate a multi-tensor call's tensors once (dtype, device, contiguity, lengths,
    memory overlap) and build its kernel descriptor; see kernels/prepared.py for the
    contract (tensors stay allocated and are not resized; ``grads=None``: per call)."""
    return prepare(_impl, params, grads, exp_avgs, exp_avg_sqs, params_lp)  # type: ignore[arg-type]


def prepare_grad_stats(grads: list[torch.Tensor]) -> PreparedGradStats:
    """``grad_stats_multi`` over fixed gradient tensors, checked once."""
    return PreparedGradStats(grads, _impl)  # type: ignore[arg-type]


# the backend's own functions, bound directly (a step calls them per bucket: no wrapper layer)
grad_stats_multi = _impl.grad_stats_multi
"""(grads, threads=None) -> (sum of squares of the finite values in fp64, count of
non-finite values)."""
rollback_risk_multi = _impl.rollback_risk_multi
"""(grads, exp_avg_sqs, *, grad_scale, c_v, threads=None) -> how many elements have
(g * grad_scale)^2 > c_v * v: the rollback guard's pre-check (runtime/auto_rollback.py);
fp32 or bf16 gradients, fp32 moments."""


def grad_stats(grad: torch.Tensor, threads: int | None = None) -> tuple[float, int]:
    return grad_stats_multi([grad], threads)


simd_path = _impl.simd_path
"""() -> the SIMD path that runs: avx512, avx2, portable, neon, sve, or torch (fallback)."""


def backend() -> str:
    """"cffi" (compiled kernel) or "torch" (fallback)."""
    return _BACKEND


__all__ = ["AdamHyper", "ExecOptions", "PreparedAdam", "PreparedGradStats", "StalePreparedCall",
           "adam_rollback", "adam_rollback_multi", "adam_step", "adam_step_multi", "backend",
           "rollback_risk_multi",
           "device_adam_multi", "grad_stats", "grad_stats_multi", "prepare_adam",
           "openmp_library", "prepare_grad_stats", "simd_path", "wait_policy"]
