"""Argument checks of the CPU Adam kernels, shared by the C wrapper and the torch fallback.

Every check runs BEFORE any memory is touched, and a failure raises TypeError (wrong type
or dtype) or ValueError (wrong value, device, layout or length) naming the argument and the
fix (STYLE.md §7). The result is a frozen `AdamCall` both backends consume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
LP_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class AdamHParams:
    """Hyper-parameters of one step (DESIGN.md §4), already range-checked."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    grad_scale: float
    sr_seed: int


@dataclass(frozen=True, slots=True)
class AdamCall:
    """One validated multi-tensor call: equal-length lists of CPU, contiguous tensors."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    params_lp: list[torch.Tensor | None] | None
    hp: AdamHParams
    threads: int
    grad_dtype: torch.dtype
    moment_dtype: torch.dtype
    lp_dtype: torch.dtype | None
    numels: list[int]


def default_threads() -> int:
    """Threads when the caller says None: what torch would use for its own CPU ops."""
    return max(1, torch.get_num_threads())


def check_threads(threads: object) -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int >= 1 or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (or None for torch.get_num_threads()), got {threads}")
    return threads


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def check_hparams(*, step: object, lr: object, beta1: object, beta2: object, eps: object,
                  weight_decay: object, adamw_mode: object, bias_correction: object,
                  grad_scale: object, sr_seed: object, rollback: bool) -> AdamHParams:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (the step number t >= 1), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first step is 1), got {step}")
    lr_f, b1, b2 = _real("lr", lr), _real("beta1", beta1), _real("beta2", beta2)
    eps_f, wd, gs = _real("eps", eps), _real("weight_decay", weight_decay), _real("grad_scale", grad_scale)
    if lr_f < 0.0:
        raise ValueError(f"lr must be >= 0, got {lr_f}")
    for name, beta in (("beta1", b1), ("beta2", b2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
        # the inverse divides by beta (in fp32): a rollback needs it representable and > 0
        if rollback and float(torch.tensor(beta, dtype=torch.float32)) <= 0.0:
            raise ValueError(f"adam_rollback cannot invert a step with {name}={beta}: use {name} > 0")
    if eps_f < 0.0:
        raise ValueError(f"eps must be >= 0, got {eps_f}")
    if wd < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {wd}")
    if gs < 0.0:
        raise ValueError(f"grad_scale must be >= 0, got {gs}")
    if not isinstance(adamw_mode, bool):
        raise TypeError(f"adamw_mode must be a bool, got {type(adamw_mode).__name__}")
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be a bool, got {type(bias_correction).__name__}")
    if adamw_mode and float(torch.tensor(1.0 - lr_f * wd, dtype=torch.float32)) <= 0.0:
        raise ValueError(f"lr * weight_decay must be < 1 in AdamW mode, got {lr_f * wd}")
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int):
        raise TypeError(f"sr_seed must be an int, got {type(sr_seed).__name__}")
    if not 0 <= sr_seed < 2**64:
        raise ValueError(f"sr_seed must be in [0, 2**64), got {sr_seed}")
    return AdamHParams(step, lr_f, b1, b2, eps_f, wd, adamw_mode, bias_correction, gs, sr_seed)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout} (sparse grads are not supported)")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}; move it with .cpu()")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous() (and copy back)")
    return t


def _as_list(name: str, seq: object) -> list:
    if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _same_dtype(name: str, tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"all {name} must share one dtype in a call, got {sorted(map(str, dtypes))}")
    return next(iter(dtypes)) if dtypes else None


def _fast_ok(t: object, dtypes: frozenset) -> bool:
    """The common case in a few cheap attribute reads (~0.3 us/tensor: a 200-tensor step
    validates in well under a millisecond); any failure is re-checked by _check_tensor for
    the message."""
    return (isinstance(t, torch.Tensor) and t.layout is torch.strided and t.dtype in dtypes
            and t.is_cpu and t.is_contiguous())


_P, _G, _M = frozenset({torch.float32}), frozenset(GRAD_DTYPES), frozenset(MOMENT_DTYPES)
_LP = frozenset(LP_DTYPES)


def check_adam_call(params: object, grads: object, exp_avgs: object, exp_avg_sqs: object,
                    params_lp: object, threads: object, *, rollback: bool,
                    **hparams: object) -> AdamCall:
    """Validate a multi-tensor call; raises before anything is modified."""
    hp = check_hparams(rollback=rollback, **hparams)  # type: ignore[arg-type]
    ps, gs = _as_list("params", params), _as_list("grads", grads)
    ms, vs = _as_list("exp_avgs", exp_avgs), _as_list("exp_avg_sqs", exp_avg_sqs)
    lps = None if params_lp is None else _as_list("params_lp", params_lp)
    n = len(ps)
    for name, seq in (("grads", gs), ("exp_avgs", ms), ("exp_avg_sqs", vs), ("params_lp", lps)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries but params has {n}")
    numels: list[int] = []
    for i in range(n):
        p, g, m, v = ps[i], gs[i], ms[i], vs[i]
        lp = None if lps is None else lps[i]
        if not (_fast_ok(p, _P) and _fast_ok(g, _G) and _fast_ok(m, _M) and _fast_ok(v, _M)
                and (lp is None or _fast_ok(lp, _LP))):
            _check_tensor(f"params[{i}]", p, (torch.float32,))
            _check_tensor(f"grads[{i}]", g, GRAD_DTYPES)
            _check_tensor(f"exp_avgs[{i}]", m, MOMENT_DTYPES)
            _check_tensor(f"exp_avg_sqs[{i}]", v, MOMENT_DTYPES)
            if lp is not None:
                _check_tensor(f"params_lp[{i}]", lp, LP_DTYPES)
        numel = p.numel()
        numels.append(numel)
        named = [("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)]
        if lp is not None:
            named.append(("params_lp", lp))
        for name, t in named:
            if t.shape != p.shape and t.numel() != numel:
                raise ValueError(f"{name}[{i}] has {t.numel()} elements but params[{i}] has {numel}")
        if numel > 0:
            ptrs = {p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr()}
            if len(ptrs) != 4 or (lp is not None and lp.data_ptr() in ptrs):
                raise ValueError(f"params[{i}], grads[{i}], exp_avgs[{i}], exp_avg_sqs[{i}] (and params_lp[{i}]) must not share memory")
    grad_dtype = _same_dtype("grads", gs) or torch.float32
    moment_dtype = _same_dtype("exp_avgs and exp_avg_sqs", ms + vs) or torch.float32
    lp_dtype = None if lps is None else _same_dtype("params_lp", [t for t in lps if t is not None])
    return AdamCall(ps, gs, ms, vs, lps, hp, check_threads(threads), grad_dtype, moment_dtype,
                    lp_dtype, numels)


def check_grads(grads: object) -> list[torch.Tensor]:
    gs = _as_list("grads", grads)
    for i, g in enumerate(gs):
        _check_tensor(f"grads[{i}]", g, GRAD_DTYPES)
    _same_dtype("grads", gs)
    return gs


AdamMulti = Callable[..., None]


def multi_entry_points(run: Callable[[AdamCall, bool], None]) -> tuple[AdamMulti, AdamMulti]:
    """The public `adam_step_multi` and `adam_rollback_multi` of a backend whose `run(call,
    rollback)` applies a validated call: both backends share one signature and one check."""

    def entry(rollback: bool) -> AdamMulti:
        def multi(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                  weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
                  params_lp=None, threads=None, sr_seed=0) -> None:
            call = check_adam_call(params, grads, exp_avgs, exp_avg_sqs, params_lp, threads,
                                   rollback=rollback, step=step, lr=lr, beta1=beta1,
                                   beta2=beta2, eps=eps, weight_decay=weight_decay,
                                   adamw_mode=adamw_mode, bias_correction=bias_correction,
                                   grad_scale=grad_scale, sr_seed=sr_seed)
            run(call, rollback)

        multi.__name__ = "adam_rollback_multi" if rollback else "adam_step_multi"
        multi.__doc__ = ("Undo adam_step_multi with the same arguments, in place."
                         if rollback else
                         "One Adam(W) step over a list of tensors in one parallel region.")
        return multi

    return entry(False), entry(True)

