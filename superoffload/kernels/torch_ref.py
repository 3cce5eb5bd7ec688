"""Pure-torch reference and fallback of the CPU Adam kernel (same signatures as the C path).

Used when the compiled module is missing (or SUPEROFFLOAD_KERNEL=torch), and as a readable
statement of the maths (DESIGN.md §4). It mirrors cext/so_adam_body.h operation by
operation (fp32, one rounding per op, no FMA; the same coefficient rounding, the same bf16 /
fp16 bit conversions and stochastic-rounding hash, the same grad_stats blocks), so the C
kernel and this file agree bit for bit. `threads` is accepted and ignored.

Legend: p param, g grad, m exp_avg, v exp_avg_sq, lp low-precision param copy, sr
stochastic rounding, bc bias correction.
"""

from __future__ import annotations

import math
import sys

import torch

from superoffload.kernels.checks import AdamCall, AdamTensors, check_grads
from superoffload.kernels.prepared import multi_entry_points

# = SO_STATS_BLOCK in cext/so_cpu_adam.h
STATS_BLOCK = 4096
_MASK32 = 0xFFFFFFFF


def _div(a: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
    """a / scalar as a true elementwise division: ATen turns division by a 0-dim tensor into
    multiplication by its reciprocal (a different rounding), so expand the divisor."""
    return a / scalar.expand_as(a)


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (as sqrtps / C sqrtf). torch's fp32 sqrt on the CPU goes
    through MKL and is off by 1 ulp on ~20% of inputs; fp64 sqrt rounded to fp32 is exact
    (53 >= 2*24 + 2 bits, so the double rounding is innocuous)."""
    return torch.sqrt(v.double()).float()


def _f32(x: float) -> torch.Tensor:
    """A Python float rounded once to fp32, as the C side's `(float)x`."""
    return torch.tensor(x, dtype=torch.float32)


def coefficients(call: AdamCall) -> dict[str, torch.Tensor]:
    """The fp32 coefficients of cext/so_cpu_adam.c so_coeffs_make(), from the same doubles."""
    hp, t = call.hyper, call.step
    # in double, then one rounding to fp32 each, as so_coeffs_make() does
    bc1, bc2 = hp.bias_corrections(t)
    return {
        "b1": _f32(hp.beta1), "b2": _f32(hp.beta2),
        "omb1": _f32(1.0 - hp.beta1), "omb2": _f32(1.0 - hp.beta2),
        "eps": _f32(hp.eps), "gs": _f32(call.grad_scale), "wd": _f32(hp.weight_decay),
        "decay": _f32(1.0 - hp.lr * hp.weight_decay) if hp.adamw_mode else _f32(1.0),
        "step_size": _f32(hp.lr / bc1), "bc2_sqrt": _f32(math.sqrt(bc2)),
    }


# ---- bit-level helpers on int64 tensors holding unsigned 32-bit values -------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _from_bits(u: torch.Tensor) -> torch.Tensor:
    signed = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)
    return signed.view(torch.float32)


def _store16(dst: torch.Tensor, u16: torch.Tensor) -> None:
    """Write unsigned 16-bit patterns into a bf16/fp16 tensor."""
    dst.view(torch.int16).copy_(torch.where(u16 >= 2**15, u16 - 2**16, u16).to(torch.int16))


def _mul32(h: torch.Tensor, k: int) -> torch.Tensor:
    """(h * k) mod 2^32 without int64 overflow: split k into 16-bit halves."""
    return (h * (k & 0xFFFF) + (((h * (k >> 16)) & 0xFFFF) << 16)) & _MASK32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """so_mix32 (lowbias32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def sr_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per global element index: so_mix32((uint32)i ^ so_sr_key(seed, i>>32))."""
    key = mix32((index >> 32) ^ 0x9E3779B9)
    key = mix32(key ^ (seed >> 32))
    key = mix32(key ^ (seed & _MASK32))
    return mix32((index & _MASK32) ^ key)


def bf16_rne_bits(x: torch.Tensor) -> torch.Tensor:
    """so_f32_to_bf16_rne: round to nearest even; NaN -> 0xffff."""
    u = _bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return torch.where((u & 0x7FFFFFFF) > 0x7F800000, 0xFFFF, rounded)


def bf16_sr_bits(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """so_f32_to_bf16_sr: add 16 random bits and truncate; inf/NaN keep their class."""
    u = _bits(x)
    rounded = (u + random16) >> 16
    special = (u >> 16) | torch.where((u & 0x7FFFFFFF) > 0x7F800000, 0x40, 0)
    return torch.where((u & 0x7F800000) == 0x7F800000, special, rounded)


def f16_rne_bits(x: torch.Tensor) -> torch.Tensor:
    """so_f32_to_f16_rne: round to nearest even, F16C NaN semantics."""
    u = _bits(x)
    sign = u & 0x80000000
    a = u ^ sign
    special = torch.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), 0x7C00)
    denorm = _from_bits(a) + _f32(0.5)
    sub = (_bits(denorm) - 0x3F000000) & _MASK32
    normal = ((a + 0xC8000FFF + ((a >> 13) & 1)) & _MASK32) >> 13
    out = torch.where(a >= 0x47800000, special, torch.where(a < 0x38800000, sub, normal))
    return out | (sign >> 16)


_RNE_BITS = {torch.bfloat16: bf16_rne_bits, torch.float16: f16_rne_bits}
"""The params_lp rounding of each accepted low-precision dtype (checks.LP_DTYPES)."""


# ---- the step and its inverse ------------------------------------------------------------

def _one(c: dict[str, torch.Tensor], call: AdamCall, i: int, index0: int, rollback: bool) -> None:
    t = call.tensors
    p, m_t, v_t = t.params[i], t.exp_avgs[i], t.exp_avg_sqs[i]
    lp = None if t.params_lp is None else t.params_lp[i]
    l2 = not call.hyper.adamw_mode and call.hyper.weight_decay != 0.0
    g = t.grads[i].float() * c["gs"]
    m, v, w = m_t.float(), v_t.float(), p.clone()
    if not rollback:
        if l2:
            g = g + c["wd"] * w
        m = c["b1"] * m + c["omb1"] * g
        # torch's order: no overflow of g*g
        v = c["b2"] * v + (c["omb2"] * g) * g
        denom = _div(_sqrt(v), c["bc2_sqrt"]) + c["eps"]
        w = w * c["decay"]
        w = w - c["step_size"] * (m / denom)
    else:
        denom = _div(_sqrt(v), c["bc2_sqrt"]) + c["eps"]
        w = w + c["step_size"] * (m / denom)
        w = _div(w, c["decay"])
        if l2:
            g = g + c["wd"] * w
        m = _div(m - c["omb1"] * g, c["b1"])
        v = _div(v - (c["omb2"] * g) * g, c["b2"])
        # fp32 cancellation can leave v < 0
        v = torch.where(v > 0.0, v, _f32(0.0))
    p.copy_(w)
    if t.moment_dtype == torch.bfloat16:
        r = sr_bits(call.sr_seed, torch.arange(index0, index0 + p.numel(), dtype=torch.int64))
        _store16(m_t, bf16_sr_bits(m.reshape(-1), r & 0xFFFF).view(m_t.shape))
        _store16(v_t, bf16_sr_bits(v.reshape(-1), r >> 16).view(v_t.shape))
    else:
        m_t.copy_(m)
        v_t.copy_(v)
    if lp is not None:
        # the fused copy out rounds to nearest even (DESIGN.md §4), unlike the bf16 moments
        _store16(lp, _RNE_BITS[lp.dtype](w))


def _check_finite_for_rollback(t: AdamTensors) -> None:
    for name, seq in (("param", t.params), ("exp_avg", t.exp_avgs),
                      ("exp_avg_sq", t.exp_avg_sqs), ("grad", t.grads)):
        for x in seq:
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"adam_rollback: {name} holds non-finite values, so the step "
                                 "cannot be inverted; nothing was modified (skip the rollback "
                                 "and restore from a snapshot)")


def simd_path() -> str:
    """The fallback runs no SIMD path of its own: "torch"."""
    return "torch"


def describe(tensors: AdamTensors) -> None:
    """The fallback needs no descriptor (the prepared-call protocol, kernels/prepared.py)."""
    return None


def describe_grads(desc: None, tensors: AdamTensors) -> None:
    return None


def run(desc: None, call: AdamCall, rollback: bool) -> None:
    """Apply a validated call (used by the public functions below and by tests)."""
    t = call.tensors
    if rollback:
        _check_finite_for_rollback(t)
    c = coefficients(call)
    # global element index across the list, as the C side counts it
    index0 = 0
    with torch.no_grad():
        for i in range(len(t.params)):
            if t.numels[i]:
                _one(c, call, i, index0, rollback)
            index0 += t.numels[i]


adam_step_multi, adam_rollback_multi = multi_entry_points(sys.modules[__name__])  # type: ignore[arg-type]


def grad_stats_describe(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return grads


def grad_stats_run(grads: list[torch.Tensor], threads: int) -> tuple[float, int]:
    return grad_stats_multi(grads)


def grad_stats_multi(grads, threads=None) -> tuple[float, int]:
    """Sum of squares of the finite values in fp64, and the non-finite count, summed in the
    C kernel's order: per tensor blocks of STATS_BLOCK, 8 lanes (element i -> lane i % 8),
    lanes added in a fixed tree, blocks added in order."""
    gs = check_grads(grads)
    partials: list[float] = []
    nonfinite = 0
    for g in gs:
        n = g.numel()
        if n == 0:
            continue
        x = g.detach().reshape(-1).double()
        finite = torch.isfinite(x)
        nonfinite += int((~finite).sum())
        sq = torch.where(finite, x, 0.0).square()
        blocks = -(-n // STATS_BLOCK)
        padded = torch.zeros(blocks * STATS_BLOCK, dtype=torch.float64)
        padded[:n] = sq
        lanes_in = padded.view(blocks, STATS_BLOCK // 8, 8)
        lane = torch.zeros(blocks, 8, dtype=torch.float64)
        # sequential per lane, as the C loop
        for k in range(STATS_BLOCK // 8):
            lane = lane + lanes_in[:, k, :]
        tree = ((lane[:, 0] + lane[:, 1]) + (lane[:, 2] + lane[:, 3])) + (
            (lane[:, 4] + lane[:, 5]) + (lane[:, 6] + lane[:, 7]))
        partials.extend(tree.tolist())
    total = 0.0
    for s in partials:
        total += s
    return total, nonfinite


def rollback_risk_multi(grads: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                        grad_scale: float, c_v: float, threads: int | None = None) -> int:
    """Elements with (g * grad_scale)^2 > c_v * v, in fp32 as cext/so_guard.c computes it."""
    gs = check_grads(grads)
    total = 0
    gsc, cv = torch.tensor(grad_scale, dtype=torch.float32), torch.tensor(c_v, dtype=torch.float32)
    for g, v in zip(gs, exp_avg_sqs):
        x = g.detach().reshape(-1).float() * gsc
        total += int(((x * x) > cv * v.detach().reshape(-1)).sum())
    return total
