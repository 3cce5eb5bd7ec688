"""Shared helpers of the kernel tests: random Adam states, a float64 reference, bit checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from superoffload.kernels import torch_ref

F32_EPS = 2.0**-23
BF16_EPS = 2.0**-7


@dataclass
class State:
    """One tensor's Adam state (and an optional low-precision copy)."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    lp: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def clone(self) -> State:
        return State(self.p.clone(), self.g.clone(), self.m.clone(), self.v.clone(),
                     None if self.lp is None else self.lp.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.p, self.g, self.m, self.v, self.lp) if t is not None]


def make_state(n: int, *, seed: int = 0, grad_dtype=torch.float32, moment_dtype=torch.float32,
               lp_dtype=None, warm: bool = True) -> State:
    """p ~ N(0,1), g ~ N(0,1); moments as after a few steps (warm) or zero."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    if warm:
        m = (0.1 * torch.randn(n, generator=gen)).to(moment_dtype)
        v = (0.01 * torch.rand(n, generator=gen) + 1e-4).to(moment_dtype)
    else:
        m = torch.zeros(n, dtype=moment_dtype)
        v = torch.zeros(n, dtype=moment_dtype)
    lp = None if lp_dtype is None else torch.zeros(n, dtype=lp_dtype)
    return State(p, g, m, v, lp)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, for bit-for-bit comparisons (NaN-safe)."""
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def assert_same_bits(a: State, b: State) -> None:
    for name, x, y in zip(["p", "g", "m", "v", "lp"], a.tensors(), b.tensors()):
        assert torch.equal(bits(x), bits(y)), (
            f"{name} differs in {int((bits(x) != bits(y)).sum())} elements")


def step_kwargs(**over) -> dict:
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              adamw_mode=True, bias_correction=True, grad_scale=1.0)
    kw.update(over)
    return kw


def run(fn, s: State, **kw) -> None:
    fn([s.p], [s.g], [s.m], [s.v], params_lp=None if s.lp is None else [s.lp], **kw)


def adam64(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay=0.0, adamw_mode=True,
           bias_correction=True, grad_scale=1.0, **_):
    """DESIGN.md §4 in float64 (PyTorch's Adam/AdamW docs), returning new (p, m, v)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * grad_scale
    if not adamw_mode:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    if adamw_mode:
        p = p * (1 - lr * weight_decay)
    p = p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v


def rollback_tolerances(post: State, pre: State, kw: dict, eps_rel: float) -> dict:
    """Per-element bounds for |restored - original|: a few roundings relative to the
    magnitudes the inverse works with (the subtraction in v cancels, so the bound is
    relative to v_post and (1-b2) g^2, not to the small result)."""
    c = {k: float(t) for k, t in torch_ref.coefficients(_call_for(pre, kw)).items()}
    g = pre.g.double() * kw.get("grad_scale", 1.0)
    m, v = post.m.double(), post.v.double()
    upd = c["step_size"] * (m.abs() / (v.sqrt() / c["bc2_sqrt"] + c["eps"]))
    p_scale = pre.p.double().abs() + post.p.double().abs() + upd
    wd = kw.get("weight_decay", 0.0) if not kw.get("adamw_mode", True) else 0.0
    g_abs = g.abs() + wd * p_scale
    m_scale = (m.abs() + c["omb1"] * g_abs) / c["b1"]
    v_scale = (v + c["omb2"] * g_abs * g_abs * 1.01) / c["b2"]
    return {"p": 4 * F32_EPS * p_scale + 4 * eps_rel * upd, "m": 4 * eps_rel * m_scale,
            "v": 4 * eps_rel * v_scale}


def _call_for(s: State, kw: dict):
    from superoffload.kernels.checks import check_call, check_tensors
    from superoffload.kernels.hyper import AdamHyper

    hyper = AdamHyper(lr=kw["lr"], beta1=kw["beta1"], beta2=kw["beta2"], eps=kw["eps"],
                      weight_decay=kw.get("weight_decay", 0.0),
                      adamw_mode=kw.get("adamw_mode", True),
                      bias_correction=kw.get("bias_correction", True))
    return check_call(check_tensors([s.p], [s.g], [s.m], [s.v]), hyper, step=kw["step"],
                      grad_scale=kw.get("grad_scale", 1.0), sr_seed=0, threads=None,
                      rollback=False, where="test")
