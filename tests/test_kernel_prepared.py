"""Prepared calls (kernels.prepare_adam): the same bits as a plain call, per-call grads,
stale tensors refused before anything is written, execution options that never change a
bit, the one thread rule as the default, and one hyper-parameter type."""

from __future__ import annotations

import os

import pytest
import torch
from _kernel_support import assert_same_bits, make_state, step_kwargs

import superoffload.kernels as K
from superoffload.kernels import torch_ref
from superoffload.kernels.checks import check_threads

needs_cffi = pytest.mark.skipif(K.backend() != "cffi", reason="compiled kernel not built")
DTYPES = [
    pytest.param((torch.float32, torch.float32, None), id="fp32"),
    pytest.param((torch.bfloat16, torch.float32, torch.bfloat16), id="mixed"),
    pytest.param((torch.bfloat16, torch.bfloat16, torch.float16), id="bf16-moments-fp16-copy"),
]
SIZES = [70_001, 3, 129_999, 64, 0, 1]


def _states(dts, seed=0):
    return [make_state(n, seed=seed + i, grad_dtype=dts[0], moment_dtype=dts[1],
                       lp_dtype=dts[2]) for i, n in enumerate(SIZES)]


def _lists(states):
    lps = None if states[0].lp is None else [s.lp for s in states]
    return [s.p for s in states], [s.g for s in states], [s.m for s in states], \
        [s.v for s in states], lps


def _hyper(kw):
    return K.AdamHyper(lr=kw["lr"], beta1=kw["beta1"], beta2=kw["beta2"], eps=kw["eps"],
                       weight_decay=kw["weight_decay"], adamw_mode=kw["adamw_mode"],
                       bias_correction=kw["bias_correction"])


@pytest.mark.parametrize("dts", DTYPES)
@pytest.mark.parametrize("per_call_grads", [False, True])
def test_prepared_equals_plain_call_bit_for_bit(dts, per_call_grads):
    kw = step_kwargs(weight_decay=0.1, grad_scale=0.5)
    a, b = _states(dts), _states(dts)
    ps, gs, ms, vs, lps = _lists(a)
    prep = K.prepare_adam(ps, None if per_call_grads else gs, ms, vs, params_lp=lps)
    assert prep.count == len(SIZES) and prep.numel == sum(SIZES)
    extra = {"grads": gs} if per_call_grads else {}
    for step in (1, 2, 3):
        kw["step"] = step
        prep.step(_hyper(kw), step=step, grad_scale=0.5, sr_seed=step, **extra)
        K.adam_step_multi(*_lists(b)[:4], params_lp=_lists(b)[4], sr_seed=step, **kw)
    prep.rollback(_hyper(kw), step=3, grad_scale=0.5, sr_seed=3, **extra)
    K.adam_rollback_multi(*_lists(b)[:4], params_lp=_lists(b)[4], sr_seed=3, **kw)
    for x, y in zip(a, b):
        assert_same_bits(x, y)


@needs_cffi
@pytest.mark.parametrize("dts", DTYPES)
def test_execution_options_never_change_a_bit(dts, monkeypatch):
    """Every schedule, chunk size (64 = many chunks per tensor), thread count and SIMD path
    gives the torch reference's bits, step and rollback."""
    from test_kernel_paths import _available_paths

    kw = step_kwargs(weight_decay=0.01, grad_scale=0.3)
    ref = _states(dts)
    torch_ref.adam_step_multi(*_lists(ref)[:4], params_lp=_lists(ref)[4], sr_seed=7, **kw)
    ref_rb = [s.clone() for s in ref]
    torch_ref.adam_rollback_multi(*_lists(ref_rb)[:4], params_lp=_lists(ref_rb)[4], sr_seed=7, **kw)
    options = [K.ExecOptions(schedule=sch, chunk_elems=chunk)
               for sch in ("static", "dynamic") for chunk in (64, 4096, 65536)]
    for path in _available_paths():
        monkeypatch.setenv("SUPEROFFLOAD_SIMD", path)
        for k, opt in enumerate(options):
            s = _states(dts)
            prep = K.prepare_adam(*_lists(s)[:4], params_lp=_lists(s)[4])
            threads = 1 + k % 3
            prep.step(_hyper(kw), step=3, grad_scale=0.3, sr_seed=7, threads=threads, options=opt)
            for x, y in zip(s, ref):
                assert_same_bits(x, y)
            prep.rollback(_hyper(kw), step=3, grad_scale=0.3, sr_seed=7, threads=threads,
                          options=opt)
            for x, y in zip(s, ref_rb):
                assert_same_bits(x, y)


def test_execution_options_are_validated():
    with pytest.raises(ValueError, match="schedule"):
        K.ExecOptions(schedule="round-robin")
    with pytest.raises(ValueError, match="chunk_elems"):
        K.ExecOptions(chunk_elems=100)
    s = make_state(10)
    prep = K.prepare_adam([s.p], [s.g], [s.m], [s.v])
    with pytest.raises(TypeError, match="options"):
        prep.step(_hyper(step_kwargs()), step=1, options={"schedule": "static"})  # type: ignore[arg-type]


def _snapshot(tensors):
    return [t.clone() for t in tensors]


def test_a_moved_tensor_is_refused_before_anything_is_written():
    s = make_state(1000, lp_dtype=torch.bfloat16)
    param = torch.nn.Parameter(s.p.clone())
    prep = K.prepare_adam([param.data], [s.g], [s.m], [s.v], params_lp=[s.lp])
    prep2 = K.prepare_adam([param], [s.g], [s.m.clone()], [s.v.clone()])
    hyper = _hyper(step_kwargs())
    prep2.step(hyper, step=1)  # fine while nothing moved
    param.data = param.data.clone()  # re-pointed: the prepared call has the old memory
    before = _snapshot([param.data, s.m, s.v, s.lp])
    assert prep2.stale() is not None
    with pytest.raises(K.StalePreparedCall, match="prepare the call again"):
        prep2.step(hyper, step=2)
    with pytest.raises(K.StalePreparedCall):
        prep2.rollback(hyper, step=1)
    for was, now in zip(before, [param.data, s.m, s.v, s.lp]):
        assert torch.equal(was, now)
    assert prep.stale() is None  # it holds param's old memory (kept alive), unchanged


def test_per_call_numbers_are_checked_and_nothing_is_written():
    s = make_state(1000)
    prep = K.prepare_adam([s.p], None, [s.m], [s.v])
    before = _snapshot([s.p, s.m, s.v])
    hyper = _hyper(step_kwargs())
    cases = [
        (dict(step=1), ValueError, "prepared without grads"),
        (dict(step=0, grads=[s.g]), ValueError, "step"),
        (dict(step=1, grads=[s.g], grad_scale=float("inf")), ValueError, "grad_scale"),
        (dict(step=1, grads=[s.g], grad_scale=1e39), ValueError, "grad_scale"),
        (dict(step=1, grads=[s.g], threads=0), ValueError, "threads"),
        (dict(step=1, grads=[s.g], sr_seed=-1), ValueError, "sr_seed"),
        (dict(step=1, grads=[s.g.double()]), TypeError, "grads[0]"),
        (dict(step=1, grads=[s.g[:-1]]), ValueError, "grads[0] has 999 elements"),
        (dict(step=1, grads=[s.g, s.g]), ValueError, "grads has 2 entries"),
        (dict(step=1, grads=[torch.zeros(2000)[::2]]), ValueError, "contiguous"),
    ]
    for kwargs, exc, fragment in cases:
        with pytest.raises(exc, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            prep.step(hyper, **kwargs)
    with pytest.raises(TypeError, match="AdamHyper"):
        prep.step(step_kwargs(), step=1, grads=[s.g])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta1"):
        prep.rollback(K.AdamHyper(lr=1e-3, beta1=0.0, beta2=0.9, eps=1e-8, weight_decay=0.0),
                      step=1, grads=[s.g])
    for was, now in zip(before, [s.p, s.m, s.v]):
        assert torch.equal(was, now)


def test_prepared_grad_stats_equal_the_plain_call_and_refuse_moved_grads():
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5000, 3, 70_000)]
    grads[2][7] = float("nan")
    stats = K.prepare_grad_stats(grads)
    assert stats() == K.grad_stats_multi(grads) == stats(threads=1)
    grads[0].mul_(2.0)  # in place: seen by the prepared call
    assert stats() == K.grad_stats_multi(grads)
    grads[0].set_(torch.zeros(5000))
    with pytest.raises(K.StalePreparedCall):
        stats()


def test_threads_default_is_the_one_thread_rule():
    """threads=None: the affinity mask (superoffload.threads), not torch.get_num_threads()."""
    from superoffload.threads import optimizer_threads, usable_cores

    assert check_threads(None) == optimizer_threads(usable_cores(), 1.0)
    if hasattr(os, "sched_getaffinity"):
        assert check_threads(None) == len(os.sched_getaffinity(0))


def test_eps_zero_is_accepted_everywhere_and_matches_torch():
    """One hyper-parameter type: eps=0 means the same to AdamHyper, the kernels and CPUAdam
    (as to torch.optim.AdamW): no floor on the denominator."""
    import superoffload as so

    hyper = K.AdamHyper.from_group({"lr": 1e-2, "betas": (0.9, 0.99), "eps": 0.0,
                                    "weight_decay": 0.0})
    assert hyper.eps == 0.0
    p0 = torch.randn(257)
    grads = [torch.randn(257) for _ in range(5)]
    ours = torch.nn.Parameter(p0.clone())
    ref = torch.nn.Parameter(p0.double())
    opt = so.CPUAdam([ours], lr=1e-2, betas=(0.9, 0.99), eps=0.0)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=0.0, weight_decay=0.0)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.double()
        opt.step()
        ref_opt.step()
    assert torch.allclose(ours.detach().double(), ref.detach(), rtol=0, atol=5e-6)
    s = make_state(100)
    K.adam_step(s.p, s.g, s.m, s.v, **step_kwargs(eps=0.0))
    assert bool(torch.isfinite(s.p).all())
    with pytest.raises(ValueError, match="eps"):
        K.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=-1e-8, weight_decay=0.0)
