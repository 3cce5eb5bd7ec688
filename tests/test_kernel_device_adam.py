"""The device (GPU tail) Adam step, kernels.device_adam_multi: the fused
path (torch._fused_adamw_ / _fused_adam_, which torch also has for the CPU, so it is tested
here) and the foreach fallback, against torch.optim.AdamW/Adam in float64 and float32,
against our CPU kernel, and with the CPU kernel's grad_scale semantics (multiply; 0 allowed).
"""

from __future__ import annotations

import pytest
import torch
from _kernel_support import adam64

import superoffload.kernels as K
from superoffload.kernels import device_adam, torch_ref

N = 1031


def _setup(seed=0, n=N, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(40)]
    return p, grads


def _ref_opt(adamw_mode, param, **kw):
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls([param], **kw)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.5, 0.37, 0.0])
def test_fused_path_matches_torch_optim_in_float64(adamw_mode, grad_dtype, grad_scale):
    """40 steps vs torch.optim in float64 fed grad * grad_scale: our fp32 error is at most
    1.5x what torch's own fp32 optimizer loses on the same run, + 1e-6."""
    p0, grads = _setup(grad_dtype=grad_dtype)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    lp = torch.empty(N, dtype=torch.bfloat16)
    assert device_adam.can_fuse([p], grads[:1], [m], [v], bias_correction=True)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    p64, p32 = torch.nn.Parameter(p0.double()), torch.nn.Parameter(p0.clone())
    opt64, opt32 = _ref_opt(adamw_mode, p64, **hp), _ref_opt(adamw_mode, p32, **hp)
    for step, g in enumerate(grads, start=1):
        g_before = g.clone()
        K.device_adam_multi([p], [g], [m], [v], step=step, lr=1e-2, beta1=0.9, beta2=0.99,
                            eps=1e-8, weight_decay=0.05, adamw_mode=adamw_mode,
                            bias_correction=True, grad_scale=grad_scale, params_lp=[lp])
        assert torch.equal(g, g_before)  # read only
        p64.grad = g.double() * grad_scale
        p32.grad = (g.float() * grad_scale)
        opt64.step()
        opt32.step()
    err = float((p.double() - p64.detach()).abs().max())
    err32 = float((p32.detach().double() - p64.detach()).abs().max())
    assert err <= 1.5 * err32 + 1e-6, (err, err32)
    assert torch.allclose(m.double(), opt64.state[p64]["exp_avg"], rtol=1e-5, atol=1e-7)
    assert torch.allclose(v.double(), opt64.state[p64]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert torch.equal(lp, p.to(torch.bfloat16))


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_path_is_torch_fused_bit_for_bit(adamw_mode):
    """Unscaled fp32 grads: the very kernel of torch.optim.AdamW(fused=True)."""
    p0, grads = _setup(seed=1)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    ref = torch.nn.Parameter(p0.clone())
    opt = _ref_opt(adamw_mode, ref, lr=1e-3, weight_decay=0.1, fused=True)
    for step, g in enumerate(grads[:10], start=1):
        K.device_adam_multi([p], [g], [m], [v], step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                            eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode,
                            bias_correction=True, grad_scale=1.0, params_lp=None)
        ref.grad = g.clone()
        opt.step()
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"])


@pytest.mark.parametrize("opts", [dict(adamw_mode=True, weight_decay=0.1),
                                  dict(adamw_mode=False, weight_decay=0.1),
                                  dict(bias_correction=False, weight_decay=0.01)],
                         ids=["adamw", "l2", "no-bias-correction"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37, 0.0])
def test_fused_foreach_and_cpu_kernel_agree(opts, grad_scale, monkeypatch):
    """The three implementations of DESIGN.md §4 agree to a few fp32 roundings after 10
    steps (the fused op uses FMA-free vector code but its own operation order)."""
    p0, grads = _setup(seed=2, grad_dtype=torch.bfloat16)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, adamw_mode=True,
              bias_correction=True, grad_scale=grad_scale, weight_decay=0.0)
    kw.update(opts)
    runs = {}
    for name in ("fused", "foreach", "cpu"):
        if name == "foreach":
            monkeypatch.setattr(device_adam, "can_fuse", lambda *a, **k: False)
        p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
        lp = torch.empty(N, dtype=torch.bfloat16)
        for step, g in enumerate(grads[:10], start=1):
            fn = torch_ref.adam_step_multi if name == "cpu" else K.device_adam_multi
            fn([p], [g], [m], [v], step=step, params_lp=[lp], **kw)
        runs[name] = (p, m, v, lp)
        monkeypatch.undo()
    for name in ("foreach", "cpu"):
        for a, b in zip(runs["fused"][:3], runs[name][:3]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
        # the copies may differ only where the fp32 values straddle a bf16 rounding tie
        assert float((runs["fused"][3].float() - runs[name][3].float()).abs().max()) <= 2**-7


def test_without_bias_correction_matches_the_float64_statement():
    p0, grads = _setup(seed=3)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    assert not device_adam.can_fuse([p], grads[:1], [m], [v], bias_correction=False)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
              bias_correction=False, grad_scale=0.5)
    P, M, V = p0.double(), torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for step, g in enumerate(grads[:5], start=1):
        K.device_adam_multi([p], [g], [m], [v], step=step, params_lp=None, **kw)
        P, M, V = adam64(P, g, M, V, step=step, **kw)
    assert torch.allclose(p.double(), P, rtol=0, atol=1e-6)


def test_scratch_grads_unscale_in_place_and_give_the_same_step():
    p0, grads = _setup(seed=4)
    a = [p0.clone(), torch.zeros(N), torch.zeros(N)]
    b = [p0.clone(), torch.zeros(N), torch.zeros(N)]
    g = grads[0].clone()
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              adamw_mode=True, bias_correction=True, grad_scale=0.25, params_lp=None)
    K.device_adam_multi([a[0]], [grads[0]], [a[1]], [a[2]], **kw)
    K.device_adam_multi([b[0]], [g], [b[1]], [b[2]], scratch_grads=True, **kw)
    assert torch.equal(g, grads[0] * 0.25)  # unscaled in place: 0.25 is a power of two
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_flat_grads_and_bad_arguments():
    p, m, v = torch.randn(4, 5), torch.zeros(4, 5), torch.zeros(4, 5)
    g = torch.randn(20)  # a flat bucket view
    K.device_adam_multi([p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert torch.allclose(m.reshape(-1), 0.1 * g)
    with pytest.raises(ValueError, match="grads has 2 entries"):
        K.device_adam_multi([p], [g, g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                            eps=1e-8)
    with pytest.raises(ValueError, match="step"):
        K.device_adam_multi([p], [g], [m], [v], step=0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="lr"):
        K.device_adam_multi([p], [g], [m], [v], step=1, lr=-1.0, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="grad_scale"):
        K.device_adam_multi([p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                            eps=1e-8, grad_scale=float("nan"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_cuda_fused_path_matches_the_cpu_float64_reference(adamw_mode, grad_scale):
    """On CUDA: bf16 grads, fused bf16 copy, 40 steps vs torch.optim in float64 on the CPU
    (the GPU fused kernel contracts into FMAs: tolerance 1.5x torch fp32's own error)."""
    p0, grads = _setup(seed=5, grad_dtype=torch.bfloat16)
    p, m, v = p0.cuda(), torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    lp = torch.empty(N, dtype=torch.bfloat16, device="cuda")
    assert device_adam.can_fuse([p], [grads[0].cuda()], [m], [v], bias_correction=True)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    p64, p32 = torch.nn.Parameter(p0.double()), torch.nn.Parameter(p0.clone())
    opt64, opt32 = _ref_opt(adamw_mode, p64, **hp), _ref_opt(adamw_mode, p32, **hp)
    for step, g in enumerate(grads, start=1):
        K.device_adam_multi([p], [g.cuda()], [m], [v], step=step, lr=1e-2, beta1=0.9,
                            beta2=0.99, eps=1e-8, weight_decay=0.05, adamw_mode=adamw_mode,
                            bias_correction=True, grad_scale=grad_scale, params_lp=[lp])
        p64.grad, p32.grad = g.double() * grad_scale, g.float() * grad_scale
        opt64.step()
        opt32.step()
    err = float((p.cpu().double() - p64.detach()).abs().max())
    err32 = float((p32.detach().double() - p64.detach()).abs().max())
    assert err <= 1.5 * err32 + 1e-6, (err, err32)
    assert torch.equal(lp, p.to(torch.bfloat16))
