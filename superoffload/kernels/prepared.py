"""Prepared kernel calls: validate a call's tensors and build its C descriptor ONCE.

A bucket's tensors never move between steps (DESIGN.md §3), yet a plain
``adam_step_multi`` call re-checks every tensor (dtype, device, contiguity, lengths, the
O(n log n) overlap check of kernels/checks.py) and rebuilds the CFFI pointer arrays each
time: ~10% of a 180-tensor ``CPUAdam.step``. A ``PreparedAdam`` does that work
once and then each ``step``/``rollback`` only checks its numbers (kernels/checks.py
``check_call``) and that no tensor moved::

    prep = kernels.prepare_adam(params, grads, exp_avgs, exp_avg_sqs, params_lp=None)
    hyper = kernels.AdamHyper.from_group(param_group)         # or AdamHyper(lr=..., ...)
    prep.step(hyper, step=t, grad_scale=1.0, threads=None, sr_seed=0)
    prep.rollback(hyper, step=t, grad_scale=1.0, threads=None, sr_seed=0)
    prep.step(hyper, step=t + 1, grads=new_grads)   # same layout, other grad tensors

Contract: the prepared tensors stay allocated and are not resized or re-pointed
(``p.data = ...``, ``resize_``, ``set_``). The prepared call holds a reference to each
tensor's memory (so a replaced tensor's old memory is never freed under it) and compares
every tensor's ``data_ptr()`` before each call (~0.1 us per tensor); a tensor that moved
raises ``StalePreparedCall`` before anything is written: prepare again. ``grads`` may be
left out at preparation (``grads=None``) and given per call, for callers whose gradients are
new tensors every step (CPUAdam under ``zero_grad(set_to_none=True)``); per-call grads are
checked against the prepared layout in O(n log n). One ``PreparedAdam`` must not be stepped
from two threads at once on the same tensors (nothing else is shared between calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from superoffload.kernels.checks import (
    AdamCall,
    AdamTensors,
    ExecOptions,
    check_call,
    check_grads,
    check_tensors,
    check_threads,
)
from superoffload.kernels.hyper import AdamHyper

_data_ptr = torch.Tensor.data_ptr


class StalePreparedCall(ValueError):
    """A prepared tensor moved (reallocated, resized or replaced through ``.data``)."""


class Backend(Protocol):
    """What kernels/cpu_adam.py and kernels/torch_ref.py provide: the prepared calls' steps
    (a descriptor built once, then run) and the functions the package binds directly
    (kernels/__init__.py); the two modules are the kernel's two implementations of it."""

    def describe(self, tensors: AdamTensors) -> Any: ...

    def describe_grads(self, desc: Any, tensors: AdamTensors) -> Any: ...

    def run(self, desc: Any, call: AdamCall, rollback: bool) -> None: ...

    def grad_stats_describe(self, grads: list[torch.Tensor]) -> Any: ...

    def grad_stats_run(self, desc: Any, threads: int) -> tuple[float, int]: ...

    def grad_stats_multi(self, grads: list[torch.Tensor],
                         threads: int | None = None) -> tuple[float, int]: ...

    def rollback_risk_multi(self, grads: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                            grad_scale: float, c_v: float, threads: int | None = None) -> int: ...

    def simd_path(self) -> str: ...


def _originals(t: AdamTensors) -> list[torch.Tensor]:
    lps = [lp for lp in t.params_lp or () if lp is not None]
    return [*t.params, *t.grads, *t.exp_avgs, *t.exp_avg_sqs, *lps]


class PreparedAdam:
    """A validated multi-tensor Adam call whose kernel descriptor is built once."""

    __slots__ = ("_backend", "_desc", "_keep", "_ptrs", "_watch", "tensors")

    def __init__(self, tensors: AdamTensors, backend: Backend) -> None:
        self.tensors = tensors
        self._backend = backend
        self._desc = backend.describe(tensors)
        self._watch = _originals(tensors)
        self._ptrs = [t.data_ptr() for t in self._watch]
        # aliases keep each tensor's current memory alive even if the caller re-points the
        # tensor (p.data = ...): the data_ptr check then fails instead of writing freed memory
        self._keep = [t.detach() for t in self._watch]

    @property
    def count(self) -> int:
        """Number of tensors in the call."""
        return len(self.tensors.params)

    @property
    def numel(self) -> int:
        """Elements stepped per call."""
        return sum(self.tensors.numels)

    def stale(self) -> str | None:
        """None while every prepared tensor is where it was; else which one moved."""
        now = list(map(_data_ptr, self._watch))
        if now == self._ptrs:
            return None
        k = next(i for i, (a, b) in enumerate(zip(now, self._ptrs)) if a != b)
        return (f"tensor {k} of the prepared call (params, grads, exp_avgs, exp_avg_sqs, "
                "params_lp in that order)")

    def step(self, hyper: AdamHyper, *, step: int, grad_scale: float = 1.0,
             threads: int | None = None, sr_seed: int = 0,
             grads: list[torch.Tensor] | None = None,
             options: ExecOptions | None = None) -> None:
        """One Adam(W) step over the prepared tensors in place (``grads`` overrides the
        prepared gradients for this call; ``options``: how it runs, never what it computes)."""
        self._run(hyper, step, grad_scale, threads, sr_seed, grads, options, rollback=False)

    def rollback(self, hyper: AdamHyper, *, step: int, grad_scale: float = 1.0,
                 threads: int | None = None, sr_seed: int = 0,
                 grads: list[torch.Tensor] | None = None,
                 options: ExecOptions | None = None) -> None:
        """Undo ``step`` with the same arguments (DESIGN.md §4), in place."""
        self._run(hyper, step, grad_scale, threads, sr_seed, grads, options, rollback=True)

    def _run(self, hyper: AdamHyper, step: int, grad_scale: float, threads: int | None,
             sr_seed: int, grads: list[torch.Tensor] | None, options: ExecOptions | None,
             rollback: bool) -> None:
        where = "adam_rollback" if rollback else "adam_step"
        moved = self.stale()
        if moved is not None:
            raise StalePreparedCall(f"{where}: {moved} no longer points at the memory it was "
                                    "prepared with (reallocated, resized or replaced through "
                                    ".data); prepare the call again")
        tensors, desc = self.tensors, self._desc
        if grads is not None:
            tensors = tensors.with_grads(grads)
            desc = self._backend.describe_grads(desc, tensors)
        elif not tensors.grads and tensors.params:
            raise ValueError(f"{where}: this call was prepared without grads; pass grads=[...]")
        call = check_call(tensors, hyper, step=step, grad_scale=grad_scale, sr_seed=sr_seed,
                          threads=threads, rollback=rollback, where=where, options=options)
        self._backend.run(desc, call, rollback)


def prepare(backend: Backend, params: list[torch.Tensor],
            grads: list[torch.Tensor] | None, exp_avgs: list[torch.Tensor],
            exp_avg_sqs: list[torch.Tensor],
            params_lp: Sequence[torch.Tensor | None] | None = None) -> PreparedAdam:
    """Validate the tensors of a call once (``kernels.prepare_adam`` binds the backend)."""
    return PreparedAdam(check_tensors(params, grads, exp_avgs, exp_avg_sqs, params_lp),
                        backend)


class PreparedGradStats:
    """``grad_stats_multi`` over fixed gradient tensors: checks and descriptor built once."""

    __slots__ = ("_backend", "_desc", "_keep", "_ptrs", "grads")

    def __init__(self, grads: list[torch.Tensor], backend: Backend) -> None:
        self.grads = check_grads(grads)
        self._backend = backend
        self._desc = backend.grad_stats_describe(self.grads)
        self._ptrs = [g.data_ptr() for g in self.grads]
        self._keep = [g.detach() for g in self.grads]

    def __call__(self, threads: int | None = None) -> tuple[float, int]:
        """(sum of squares of the finite values in fp64, count of non-finite values)."""
        if [g.data_ptr() for g in self.grads] != self._ptrs:
            raise StalePreparedCall("grad_stats: a prepared gradient moved (reallocated or "
                                    "replaced through .data); prepare the call again")
        return self._backend.grad_stats_run(self._desc, check_threads(threads))


AdamMulti = Callable[..., None]


def multi_entry_points(backend: Backend) -> tuple[AdamMulti, AdamMulti]:
    """The public ``adam_step_multi`` and ``adam_rollback_multi`` of a backend: both
    backends share one keyword signature and one check (an unprepared call: everything is
    checked on every call; prefer ``prepare_adam`` for repeated calls)."""

    def entry(rollback: bool) -> AdamMulti:
        where = "adam_rollback_multi" if rollback else "adam_step_multi"

        def multi(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
                  weight_decay=0.0, adamw_mode=True, bias_correction=True, grad_scale=1.0,
                  params_lp=None, threads=None, sr_seed=0, maximize=False) -> None:
            hyper = AdamHyper.checked(where, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, adamw_mode=adamw_mode,
                                      bias_correction=bias_correction, maximize=maximize)
            if grads is None:
                raise TypeError(f"{where}: grads must be a list or tuple of tensors, got None")
            tensors = check_tensors(params, grads, exp_avgs, exp_avg_sqs, params_lp)
            call = check_call(tensors, hyper, step=step, grad_scale=grad_scale,
                              sr_seed=sr_seed, threads=threads, rollback=rollback,
                              where=where)
            backend.run(backend.describe(tensors), call, rollback)

        multi.__name__ = where
        multi.__doc__ = "One Adam(W) step over a list of tensors in one parallel region."
        if rollback:
            multi.__doc__ = "Undo adam_step_multi with the same arguments, in place."
        return multi

    return entry(False), entry(True)
