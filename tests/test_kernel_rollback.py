"""adam_rollback: the exact inverse of adam_step for every option (DESIGN.md §4).

"Within a few ulps" is measured against the magnitudes the inverse computes with (see
_kernel_support.rollback_tolerances): 4 roundings of fp32 (or of bf16 for bf16 moments)."""

from __future__ import annotations

import pytest
import torch
from _kernel_support import BF16_EPS, F32_EPS, make_state, rollback_tolerances, run, step_kwargs
from hypothesis import given, settings
from hypothesis import strategies as st

import superoffload.kernels as K

OPTIONS = [
    pytest.param(dict(), id="adamw"),
    pytest.param(dict(weight_decay=0.1), id="adamw-wd"),
    pytest.param(dict(adamw_mode=False, weight_decay=0.1), id="l2"),
    pytest.param(dict(bias_correction=False, weight_decay=0.01), id="no-bias-correction"),
    pytest.param(dict(grad_scale=1 / 3, step=1), id="grad-scale-step1"),
    pytest.param(dict(beta1=0.5, beta2=0.9, lr=0.05, step=1000), id="small-betas"),
]
DTYPES = [
    pytest.param((torch.float32, torch.float32, None), id="fp32"),
    pytest.param((torch.bfloat16, torch.float32, torch.bfloat16), id="bf16-grad-bf16-copy"),
    pytest.param((torch.float32, torch.float32, torch.float16), id="fp16-copy"),
    pytest.param((torch.bfloat16, torch.bfloat16, None), id="bf16-moments"),
]


def _check_restored(before, after_rb, post, kw, moment_dtype):
    eps_rel = BF16_EPS if moment_dtype == torch.bfloat16 else F32_EPS
    tol = rollback_tolerances(post, before, kw, eps_rel)
    for name in ("p", "m", "v"):
        got, want = getattr(after_rb, name).double(), getattr(before, name).double()
        err = (got - want).abs()
        assert bool((err <= tol[name]).all()), (
            f"{name}: worst err/tol {float((err / tol[name]).max()):.2f}")
    assert bool((after_rb.v >= 0).all())


@pytest.mark.parametrize("dts", DTYPES)
@pytest.mark.parametrize("opts", OPTIONS)
def test_step_then_rollback_restores_state(opts, dts):
    s = make_state(20011, seed=5, grad_dtype=dts[0], moment_dtype=dts[1], lp_dtype=dts[2])
    before = s.clone()
    kw = step_kwargs(**opts)
    run(K.adam_step_multi, s, sr_seed=11, **kw)
    post = s.clone()
    run(K.adam_rollback_multi, s, sr_seed=11, **kw)
    _check_restored(before, s, post, kw, dts[1])
    assert torch.equal(s.g, before.g)  # the grad is read-only
    if s.lp is not None:  # the copy follows the restored param
        assert torch.equal(s.lp, s.p.to(s.lp.dtype))


@settings(max_examples=40, deadline=None)
@given(step=st.integers(1, 10000), lr=st.floats(1e-6, 0.1), beta1=st.floats(0.05, 0.99),
       beta2=st.floats(0.5, 0.9999), wd=st.sampled_from([0.0, 0.01, 0.3]),
       adamw_mode=st.booleans(), bias_correction=st.booleans(),
       grad_scale=st.sampled_from([1.0, 0.125, 2.5]))
def test_rollback_property(step, lr, beta1, beta2, wd, adamw_mode, bias_correction, grad_scale):
    s = make_state(513, seed=step)
    before = s.clone()
    kw = step_kwargs(step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                     adamw_mode=adamw_mode, bias_correction=bias_correction,
                     grad_scale=grad_scale)
    run(K.adam_step_multi, s, **kw)
    post = s.clone()
    run(K.adam_rollback_multi, s, **kw)
    _check_restored(before, s, post, kw, torch.float32)


def test_v_clamped_at_zero_never_negative():
    """From zero moments a step gives v = (1-b2) g^2; undoing it cancels exactly or leaves
    a tiny negative in fp32, which the clamp turns into 0 (never a negative v)."""
    s = make_state(50000, seed=6, warm=False)
    kw = step_kwargs(step=1, beta2=0.95)
    run(K.adam_step_multi, s, **kw)
    run(K.adam_rollback_multi, s, **kw)
    assert bool((s.v >= 0).all())
    assert float(s.v.max()) <= 4 * F32_EPS * float(((1 - 0.95) * s.g.double() ** 2).max()) / 0.95


@pytest.mark.parametrize("opts", OPTIONS[:3])
def test_repeated_step_rollback_does_not_drift(opts):
    """50 rounds of step+rollback (as STV does on every clipped iteration) stay within the
    one-round bound times sqrt(rounds)-ish: no systematic drift."""
    s = make_state(4096, seed=7)
    before = s.clone()
    kw = step_kwargs(**opts)
    worst = 0.0
    for _ in range(50):
        run(K.adam_step_multi, s, **kw)
        run(K.adam_rollback_multi, s, **kw)
    drift = (s.p.double() - before.p.double()).abs() / (before.p.double().abs() + 1e-3)
    worst = float(drift.max())
    assert worst < 50 * F32_EPS, worst
    drift_m = (s.m.double() - before.m.double()).abs() / (before.m.double().abs() + 1e-3)
    assert float(drift_m.max()) < 200 * F32_EPS


@pytest.mark.parametrize("what", ["p", "m", "v", "g"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rollback_refuses_nonfinite_and_writes_nothing(what, bad):
    s = make_state(70000, seed=8, lp_dtype=torch.bfloat16)
    kw = step_kwargs()
    run(K.adam_step_multi, s, **kw)
    getattr(s, what)[69999 if what in "pv" else 12345] = bad
    snapshot = s.clone()
    name = {"p": "param", "m": "exp_avg", "v": "exp_avg_sq", "g": "grad"}[what]
    with pytest.raises(ValueError, match=name):
        run(K.adam_rollback_multi, s, **kw)
    for x, y in zip(s.tensors(), snapshot.tensors()):
        assert torch.equal(x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32),
                           y.view(torch.int16) if y.element_size() == 2 else y.view(torch.int32))


def test_rollback_of_multi_step_over_many_tensors():
    sizes = [1, 7, 64, 1000, 33333]
    states = [make_state(n, seed=i) for i, n in enumerate(sizes)]
    before = [s.clone() for s in states]
    kw = step_kwargs(weight_decay=0.02)
    lists = ([s.p for s in states], [s.g for s in states], [s.m for s in states],
             [s.v for s in states])
    K.adam_step_multi(*lists, **kw)
    post = [s.clone() for s in states]
    K.adam_rollback_multi(*lists, **kw)
    for b, s, q in zip(before, states, post):
        _check_restored(b, s, q, kw, torch.float32)
