"""A step that would make the optimizer state non-finite counts as a non-finite step.

The STV verdict (paper §4.3) skips an iteration whose gradient holds inf/nan. A finite but
huge gradient can still overflow what the step writes: ``exp_avg_sq`` gets (1-b2) g^2, which
exceeds fp32's maximum for |g| > ~5.8e20 at b2 = 0.999 (torch.optim.AdamW writes inf there,
and the parameter then never moves again: m / inf = 0). The engine counts such a bucket as
non-finite instead: the iteration is skipped on every rank and its speculative steps rolled
back, as for a non-finite gradient, and the bucket is reported (``EngineStats.
nonfinite_buckets`` and a telemetry note).

Legend: g = the gradient the kernel reads (grad * scale, + wd * p in L2 mode), G = a bound
of max |g| from the validation statistics: G = sqrt(sum_sq) * |scale| (every element's square
is part of the sum).

Cost: nothing in a sane run. ``may_overflow`` decides from G alone whether the step could
overflow; only then are copies of the bucket's p, m, v stepped with the bucket's own kernel
call (``trial``), the real state untouched, and the non-finite results counted: exact, since
it is the same kernel on the same values. The speculative step does this before it writes
(``runtime/steps.py``); validation asks the speculative step's result, or tries the bucket
itself when it was not speculated.

Premises of the bound (docs/failure_semantics.md): the state before the step is finite; in
L2 mode |wd * p| <= 2^60 (the decay enters g); |p| and the update lr * m / (sqrt(v) + eps)
stay far below fp32's maximum (a weight moves by about lr per step). ``eps == 0`` is always
tried (m / sqrt(v) is 0/0 where v is 0). b2 within 2^-20 of 1 is always tried too (v may then
sit near fp32's maximum whatever g is).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from superoffload import kernels
from superoffload.kernels import AdamHyper

if TYPE_CHECKING:
    from superoffload.runtime.engine_state import BucketBuffers


class Call(Protocol):
    """A kernel call over bucket positions (``steps.KernelCall``)."""

    @property
    def members(self) -> tuple[int, ...]: ...

    @property
    def step(self) -> int: ...

    @property
    def hyper(self) -> AdamHyper: ...

FLT_MAX = 3.4028234663852886e38
ROUNDING_MARGIN = 2.0**-20
"""Relative room left for the roundings of v' = b2 v + ((1-b2) g) g (five of 2^-24 each)."""
L2_WEIGHT_BOUND = 2.0**60
"""The premise on |p| in L2 mode, where wd * p is part of g."""
# clip_grad_norm_'s max_norm / (norm + 1e-6), runtime/stv.py
CLIP_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class StateOverflow:
    """A speculative step not taken: it would have written ``elements`` non-finite values
    into p, m or v. Falsy, like any step that did not run (the rollback has nothing to undo)."""

    elements: int

    def __bool__(self) -> bool:
        return False


def may_overflow(sum_sq: float, scale: float, hypers: Iterable[AdamHyper]) -> bool:
    """Whether a step with gradients of squared norm ``sum_sq`` times ``scale`` could write a
    non-finite state under any of ``hypers`` (False: it cannot, given the premises above)."""
    # g = fl(grad * scale)
    g_max = math.sqrt(sum_sq) * abs(scale) * (1.0 + ROUNDING_MARGIN)
    for h in hypers:
        if h.eps == 0.0:
            return True
        g = g_max + (h.weight_decay * L2_WEIGHT_BOUND if not h.adamw_mode else 0.0)
        # v' <= b2 v + (1-b2) G^2 stays below FLT_MAX for every finite v iff the headroom
        # (1-b2) (FLT_MAX - G^2) covers the roundings
        if (1.0 - h.beta2) * (FLT_MAX - g * g) < ROUNDING_MARGIN * FLT_MAX:
            return True
    return False


def _nonfinite(tensors: Iterable[torch.Tensor]) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


def trial(buf: BucketBuffers, calls: Sequence[Call], grads: Sequence[torch.Tensor], *,
          grad_scale: float, threads: int | None, seeds: Sequence[int]) -> int:
    """Elements whose p, m or v the step of ``calls`` would make non-finite: the same kernel
    call as ``steps.run_calls`` (same hyper-parameters, scale and stochastic-rounding seed per
    call, ``seeds``) on copies of the bucket's state. ``grads`` indexed by bucket position."""
    on_cpu = buf.master[0].device.type == "cpu" if buf.master else True
    bad = 0
    with torch.no_grad():
        for k, call in enumerate(calls):
            idx = call.members
            p = [buf.master[i].detach().clone() for i in idx]
            m = [buf.exp_avg[i].clone() for i in idx]
            v = [buf.exp_avg_sq[i].clone() for i in idx]
            # the kernels read fp32 or bf16 gradients: fp16 ones are widened, as device_step does
            g = [grads[i].float() if grads[i].dtype == torch.float16 else grads[i]
                 for i in idx]
            h = call.hyper
            if on_cpu:
                kernels.prepare_adam(p, None, m, v).step(
                    h, step=call.step, grad_scale=grad_scale, threads=threads,
                    sr_seed=seeds[k], grads=g)
            else:
                kernels.device_adam_multi(
                    p, g, m, v, step=call.step, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                    eps=h.eps, weight_decay=h.weight_decay, adamw_mode=h.adamw_mode,
                    bias_correction=h.bias_correction, grad_scale=grad_scale,
                    maximize=h.maximize)
            bad += _nonfinite(p) + _nonfinite(m) + _nonfinite(v)
    return bad


def clipped_safely(sum_sq: float, scale: float, hypers: Sequence[AdamHyper],
                   clip: float | None) -> bool:
    """Clipping is certain (this bucket's norm alone exceeds ``clip``), and once clipped no
    element of g exceeds ``clip``: the step that will run cannot overflow, whatever the
    unclipped one would do."""
    if not clip or math.sqrt(sum_sq) * abs(scale) <= clip * (1 + CLIP_EPS):
        return False
    return not may_overflow(clip * clip, 1.0, hypers)
