"""Adam(W) on the device for GPU tail buckets (paper §4.2): PyTorch's fused kernel.

The compiled kernel is CPU-only; a GPU tail bucket's fp32 master and moments live on the
device and are stepped there with the verdict's clip/unscale factor. The keyword signature
is the kernels' (``adam_step_multi``), so the engine calls either through one path.

Fused path: ``torch._fused_adamw_`` / ``torch._fused_adam_`` (the kernels of
``torch.optim.AdamW(fused=True)``: one multi-tensor launch that reads p, g, m, v and writes
p, m, v, 28 B/param for fp32), then ``torch._foreach_copy_`` for the low-precision copy (one
launch, 6 B/param). Differences from our CPU kernel that the wrapper absorbs:

* the fused op DIVIDES the gradient by its ``grad_scale`` tensor and writes the unscaled
  gradient back (``Tensor(b!)`` in its schema); ours MULTIPLIES by ``grad_scale``. So the
  gradient is scaled into a temporary (``_foreach_mul``, 8 B/param) unless the caller says
  its gradients are scratch (``scratch_grads=True``: the op divides them in place by
  ``1/grad_scale``, 4 B/param) or they need a dtype cast anyway (the fp32 temporaries are
  ours); ``grad_scale == 0`` divides by inf, which gives 0 for finite g as g * 0 does;
* it reads the step count from a tensor per parameter (``state_steps``), so one is filled
  per call (one launch, no host sync) and it always bias-corrects: ``bias_correction=False``
  takes the foreach path;
* it needs grads of the params' dtype: bf16 gradients are widened into fp32 temporaries
  (one ``_foreach_copy_``, 6 B/param).

Foreach path (the fallback: ``bias_correction=False``, mixed dtypes or devices, a device
without fused kernels): the same maths in ~11 ``_foreach`` ops, ~102 B/param. Same order
of operations as the CPU kernel (DESIGN.md §4, kernels/torch_ref.py). Both paths are
checked against torch.optim.AdamW/Adam in tests/test_kernel_device_adam.py.
"""

from __future__ import annotations

import math

import torch

from superoffload.kernels.hyper import AdamHyper

_FUSED_DTYPES = (torch.float32, torch.float64)


def _fused_devices() -> frozenset[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return frozenset(_get_fused_kernels_supported_devices())


def can_fuse(params: list[torch.Tensor], grads: list[torch.Tensor],
             exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
             bias_correction: bool) -> bool:
    """Whether ``device_adam_multi`` takes the fused path for these tensors: bias
    correction on, params and moments of one fp32/fp64 dtype on one device with fused
    kernels, grads on that device (any floating dtype: widened when it differs)."""
    if not bias_correction or not params:
        return False
    dev, dtype = params[0].device, params[0].dtype
    if dtype not in _FUSED_DTYPES or dev.type not in _fused_devices():
        return False
    same = all(t.device == dev and t.dtype == dtype
               for seq in (params, exp_avgs, exp_avg_sqs) for t in seq)
    return same and all(g.device == dev and g.is_floating_point() and not g.is_sparse
                        for g in grads)


def device_adam_multi(params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                      step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float = 0.0, adamw_mode: bool = True,
                      bias_correction: bool = True, grad_scale: float = 1.0,
                      params_lp: list[torch.Tensor] | None = None, threads: int | None = None,
                      sr_seed: int = 0, scratch_grads: bool = False,
                      maximize: bool = False) -> None:
    """One Adam(W) step over device tensors in place; ``params_lp`` receives the cast copy.
    ``grads`` are read only, unless ``scratch_grads=True`` lets the fused op unscale them in
    place (saves a pass). ``threads`` and ``sr_seed`` are accepted for the kernels' signature
    and ignored (fp32 moments only). ``maximize``: a step with -grad (AdamW's flag)."""
    hyper = AdamHyper.checked("device_adam_multi", lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, adamw_mode=adamw_mode,
                              bias_correction=bias_correction, maximize=maximize)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"device_adam_multi: step must be an int >= 1, got {step!r}")
    gs = float(grad_scale)
    if not 0.0 <= gs < math.inf:
        raise ValueError(f"device_adam_multi: grad_scale must be finite and >= 0, got {gs}")
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("params_lp", params_lp)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"device_adam_multi: {name} has {len(seq)} entries, params {n}")
    if not n:
        return
    with torch.no_grad():
        if can_fuse(params, grads, exp_avgs, exp_avg_sqs, bias_correction=bias_correction):
            _fused(params, grads, exp_avgs, exp_avg_sqs, hyper, step, gs, scratch_grads)
        else:
            _foreach(params, grads, exp_avgs, exp_avg_sqs, hyper, step, gs)
        if params_lp is not None:
            # one launch, casts with RNE
            torch._foreach_copy_(params_lp, params)


def _fused(params: list[torch.Tensor], grads: list[torch.Tensor],
           exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], h: AdamHyper,
           step: int, gs: float, scratch_grads: bool) -> None:
    dev, dtype = params[0].device, params[0].dtype
    scale: torch.Tensor | None = None
    # flat bucket views, say
    if any(g.shape != p.shape for g, p in zip(grads, params)):
        grads = [g.view(p.shape) for g, p in zip(grads, params)]
    if any(g.dtype != dtype for g in grads):
        # widen into temporaries of our own; the op may then unscale them in place
        wide = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        torch._foreach_copy_(wide, grads)
        grads = wide
        scratch_grads = True
    if gs != 1.0:
        # the op computes g / scale: divide by 1/gs (inf for gs == 0)
        if scratch_grads:
            inv = math.inf
            if gs != 0.0:
                inv = 1.0 / gs
            scale = torch.full((), inv, dtype=torch.float32, device=dev)
        else:
            # exactly g * gs, as the CPU kernel, without touching the caller's grads
            grads = list(torch._foreach_mul(grads, gs))
    steps = torch.full((len(params),), float(step), dtype=torch.float32, device=dev).unbind()
    op = torch._fused_adamw_ if h.adamw_mode else torch._fused_adam_
    op(params, grads, exp_avgs, exp_avg_sqs, [], list(steps), lr=h.lr, beta1=h.beta1,
       beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=h.maximize,
       grad_scale=scale, found_inf=None)


def _foreach(params: list[torch.Tensor], grads: list[torch.Tensor],
             exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], h: AdamHyper,
             step: int, gs: float) -> None:
    # foreach ops: one launch per op over all tensors (torch.optim's foreach AdamW idea).
    bc1, bc2 = h.bias_corrections(step)
    bc2_sqrt = math.sqrt(bc2)
    dtype = params[0].dtype
    # .to() hands back the tensor itself when it has the dtype already: no copy then
    g32 = [x.to(dtype) for x in grads]
    # maximize: -grad, folded into the scale (exact: a sign flip)
    if h.maximize:
        gs = -gs
    g = list(torch._foreach_mul(g32, gs))
    if not h.adamw_mode and h.weight_decay != 0.0:
        # Adam with L2: decay in the moments
        torch._foreach_add_(g, params, alpha=h.weight_decay)
    torch._foreach_mul_(exp_avgs, h.beta1)
    torch._foreach_add_(exp_avgs, g, alpha=1.0 - h.beta1)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - h.beta2)
    if h.adamw_mode and h.weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - h.lr * h.weight_decay)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-h.lr / bc1)
