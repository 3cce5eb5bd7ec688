"""CPU Adam kernel numerics: against torch.optim (fp64 and fp32), a float64 statement of
DESIGN.md §4, and the torch fallback (bit for bit); bf16 grads, fused bf16/fp16 copies,
bf16 moments with stochastic rounding."""

from __future__ import annotations

import pytest
import torch
from _kernel_support import (
    adam64,
    assert_same_bits,
    bits,
    make_state,
    run,
    step_kwargs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import superoffload.kernels as K
from superoffload.kernels import torch_ref

BACKENDS = [pytest.param(torch_ref, id="torch")]
if K.backend() == "cffi":
    from superoffload.kernels import cpu_adam

    BACKENDS.insert(0, pytest.param(cpu_adam, id="cffi"))


def _torch_optimizer(adamw_mode: bool, params, **kw):
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, **kw)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_many_steps_match_torch_optim_in_float64(impl, adamw_mode):
    """200 steps of our fp32 kernel vs torch.optim in float64. fp32 itself costs accuracy
    (e.g. 1 - lr*wd rounded to fp32 biases every step), so the bound is relative to what
    torch's own fp32 optimizer loses on the same run: at most 1.5x its error + 1e-6."""
    s = make_state(1031, warm=False)
    p64 = s.p.double().clone()
    p32 = s.p.clone()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    opt64 = _torch_optimizer(adamw_mode, [p64], **hp)
    opt32 = _torch_optimizer(adamw_mode, [p32], **hp)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 201):
        g = torch.randn(s.p.numel(), generator=gen)
        s.g.copy_(g)
        run(impl.adam_step_multi, s, **step_kwargs(step=step, weight_decay=0.05,
                                                     adamw_mode=adamw_mode))
        p64.grad, p32.grad = g.double(), g.clone()
        opt64.step()
        opt32.step()
    err_ours = float((s.p.double() - p64).abs().max())
    err_torch32 = float((p32.double() - p64).abs().max())
    assert err_ours <= 1.5 * err_torch32 + 1e-6, (err_ours, err_torch32)
    st64 = opt64.state[p64]
    assert torch.allclose(s.m.double(), st64["exp_avg"], rtol=1e-5, atol=1e-7)
    assert torch.allclose(s.v.double(), st64["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_fused_fp32(adamw_mode):
    """Against torch's fused fp32 AdamW/Adam for 30 steps: within 1e-6 absolute."""
    s = make_state(1000, warm=False)
    p_ref = s.p.clone()
    opt = _torch_optimizer(adamw_mode, [p_ref], lr=1e-2, weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 31):
        g = torch.randn(1000, generator=gen)
        s.g.copy_(g)
        K.adam_step(s.p, s.g, s.m, s.v, **step_kwargs(step=step, lr=1e-2, weight_decay=0.1,
                                                       adamw_mode=adamw_mode))
        p_ref.grad = g.clone()
        opt.step()
    assert torch.allclose(s.p, p_ref, rtol=0, atol=1e-6)


hparams = st.fixed_dictionaries({
    "step": st.integers(1, 5000),
    "lr": st.floats(1e-6, 0.1),
    "beta1": st.floats(0.01, 0.999),
    "beta2": st.floats(0.5, 0.99999),
    "eps": st.floats(1e-12, 1e-3),
    "weight_decay": st.sampled_from([0.0, 1e-4, 0.01, 0.5]),
    "adamw_mode": st.booleans(),
    "bias_correction": st.booleans(),
    "grad_scale": st.sampled_from([1.0, 0.5, 1 / 1024, 3.7]),
})
dtypes = st.tuples(st.sampled_from([torch.float32, torch.bfloat16]),
                   st.sampled_from([torch.float32, torch.bfloat16]),
                   st.sampled_from([None, torch.bfloat16, torch.float16]))


@settings(max_examples=60, deadline=None)
@given(kw=hparams, dts=dtypes, seed=st.integers(0, 2**64 - 1), n=st.integers(1, 300))
def test_kernel_equals_torch_fallback_bit_for_bit(kw, dts, seed, n):
    """The C kernel and torch_ref.py implement the same ops in the same order: every option
    and dtype combination gives identical bits, step and rollback."""
    if K.backend() != "cffi":
        pytest.skip("compiled kernel not built")
    a = make_state(n, seed=n, grad_dtype=dts[0], moment_dtype=dts[1], lp_dtype=dts[2])
    b = a.clone()
    run(cpu_adam.adam_step_multi, a, sr_seed=seed, **kw)
    run(torch_ref.adam_step_multi, b, sr_seed=seed, **kw)
    assert_same_bits(a, b)
    run(cpu_adam.adam_rollback_multi, a, sr_seed=seed, **kw)
    run(torch_ref.adam_rollback_multi, b, sr_seed=seed, **kw)
    assert_same_bits(a, b)


@settings(max_examples=40, deadline=None)
@given(kw=hparams, grad_bf16=st.booleans())
def test_one_step_matches_float64_statement(kw, grad_bf16):
    """One fp32 step vs DESIGN.md §4 in float64, bias correction on or off, bf16 grads.
    Tolerance: 4 fp32 roundings (2^-24 each) of the magnitudes each result is built from,
    so a cancellation (b1*m close to -(1-b1)*g) is judged against its operands."""
    s = make_state(257, grad_dtype=torch.bfloat16 if grad_bf16 else torch.float32)
    p0, g0, m0, v0 = (t.double() for t in (s.p, s.g, s.m, s.v))
    p64, m64, v64 = adam64(s.p, s.g, s.m, s.v, **kw)
    K.adam_step(s.p, s.g, s.m, s.v, **kw)
    u = 2.0**-24
    g = g0.abs() * kw["grad_scale"] + (0.0 if kw["adamw_mode"] else kw["weight_decay"]) * p0.abs()
    tol_m = 4 * u * (m0.abs() + g.abs()) + 1e-30
    tol_v = 4 * u * (v0 + g * g) + 1e-30
    bc1 = 1 - kw["beta1"] ** kw["step"] if kw["bias_correction"] else 1.0
    bc2 = 1 - kw["beta2"] ** kw["step"] if kw["bias_correction"] else 1.0
    denom = v64.sqrt() / bc2**0.5 + kw["eps"]
    upd = kw["lr"] / bc1 * m64.abs() / denom
    # denom's own error (sqrt of an inexact v, eps) is relative: 8 roundings of upd
    tol_p = 4 * u * (p0.abs() + p64.abs()) + kw["lr"] / bc1 * tol_m / denom + 8 * u * upd * (
        1 + tol_v / (v64 + 1e-300))
    assert bool(((s.m.double() - m64).abs() <= tol_m).all())
    assert bool(((s.v.double() - v64).abs() <= tol_v).all())
    assert bool(((s.p.double() - p64).abs() <= tol_p).all()), (
        float(((s.p.double() - p64).abs() / tol_p).max()))


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
def test_fused_copy_equals_torch_cast_bit_for_bit(impl, lp_dtype):
    """param_lp equals p.to(lp_dtype) bit for bit, including NaN, inf, overflow to inf,
    subnormal halves, ties (round to nearest even) and signed zeros."""
    s = make_state(70000, lp_dtype=lp_dtype)
    s.p.mul_(torch.logspace(-30, 30, 70000) if lp_dtype == torch.bfloat16
             else torch.logspace(-9, 6, 70000))
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0,
                            -0.0, 65504.0, 65519.99, 65520.0, 1e-8, 6e-8, -3e-5,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38])
    s.p[: len(special)] = special
    s.g[: len(special)] = 0.0
    run(impl.adam_step_multi, s, lr=0.0, weight_decay=0.0, **{k: v for k, v in step_kwargs().items()
                                                            if k not in ("lr", "weight_decay")})
    expect = s.p.to(lp_dtype)
    nan = torch.isnan(s.p)
    assert bool(torch.isnan(s.lp[nan].float()).all())
    assert torch.equal(bits(s.lp)[~nan], bits(expect)[~nan])
    # NaN patterns: this torch build's conversion, checked on the NaNs the step produced
    assert torch.equal(bits(s.lp)[nan], bits(expect)[nan])


@pytest.mark.parametrize("impl", BACKENDS)
def test_bf16_grads_equal_fp32_grads_of_the_same_values(impl):
    a = make_state(5000, grad_dtype=torch.bfloat16)
    b = a.clone()
    b.g = a.g.float()
    run(impl.adam_step_multi, a, **step_kwargs(grad_scale=0.25))
    run(impl.adam_step_multi, b, **step_kwargs(grad_scale=0.25))
    assert torch.equal(a.p, b.p) and torch.equal(a.m, b.m) and torch.equal(a.v, b.v)


def test_stochastic_rounding_is_unbiased():
    """bf16 moments use stochastic rounding: over many seeds the mean of the stored m is
    the fp32 value (round-to-nearest would be biased by up to half a bf16 ulp)."""
    n, seeds = 2048, 256
    target = 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(3)) * 2**-7
    acc = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        p = torch.zeros(n)
        # beta1 = 0: m = g exactly before rounding
        K.adam_step(p, target.clone(), m, v, step=1, lr=0.0, beta1=0.0, beta2=0.5, eps=1e-8,
                    sr_seed=seed)
        acc += m.double()
    mean_err = (acc / seeds - target.double()).abs()
    ulp = 2**-7
    # per element: sd of one draw <= ulp/2, so sd of the mean <= ulp/32; 6 sd bound
    assert float(mean_err.max()) < 6 * ulp / (2 * seeds**0.5)
    assert float((acc / seeds - target.double()).mean().abs()) < ulp / 200  # no global bias


def test_bf16_moments_track_fp32_moments():
    """300 steps with bf16 moments (SR) vs fp32 moments: the parameters drift apart by a
    small fraction of how far they moved (the accuracy cost stated in docs/kernel.md)."""
    a = make_state(20000, warm=False)
    b = make_state(20000, warm=False, moment_dtype=torch.bfloat16)
    p0 = a.p.clone()
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 301):
        g = torch.randn(20000, generator=gen) * 0.1 + 0.02
        a.g.copy_(g)
        b.g.copy_(g)
        run(K.adam_step_multi, a, **step_kwargs(step=step, lr=1e-3))
        run(K.adam_step_multi, b, **step_kwargs(step=step, lr=1e-3), sr_seed=step)
    moved = (a.p - p0).abs().mean()
    drift = (a.p - b.p).abs().mean()
    assert float(drift) < 0.01 * float(moved), (float(drift), float(moved))
