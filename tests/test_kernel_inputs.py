"""Bad input is refused before any memory is touched: TypeError for types and dtypes,
ValueError for values, devices, layouts and lengths, each naming the argument."""

from __future__ import annotations

import re

import pytest
import torch
from _kernel_support import make_state, step_kwargs

import superoffload.kernels as K
from superoffload.kernels import torch_ref

IMPLS = [pytest.param(torch_ref, id="torch")]
if K.backend() == "cffi":
    from superoffload.kernels import cpu_adam

    IMPLS.insert(0, pytest.param(cpu_adam, id="cffi"))


def _bad_cases():
    """(name, mutate(args, kwargs), exception, message fragment)."""

    def tensor(i, value):
        def mutate(args, kw):
            args[i] = [value(args[i][0])]
        return mutate

    def hp(key, value):
        def mutate(args, kw):
            kw[key] = value
        return mutate

    return [
        ("grad fp16", tensor(1, lambda g: g.half()), TypeError, "grads[0]"),
        ("param bf16", tensor(0, lambda p: p.bfloat16()), TypeError, "params[0]"),
        ("moment fp64", tensor(2, lambda m: m.double()), TypeError, "exp_avgs[0]"),
        ("moment dtypes differ", tensor(3, lambda v: v.bfloat16()), TypeError, "exp_avg"),
        ("device", tensor(1, lambda g: g.to("meta")), ValueError, "grads[0]"),
        ("non-contiguous", tensor(2, lambda m: torch.zeros(2 * m.numel())[::2]), ValueError,
         "contiguous"),
        ("length", tensor(3, lambda v: v[:-1].clone()), ValueError, "exp_avg_sqs[0]"),
        ("not a tensor", tensor(1, lambda g: g.tolist()), TypeError, "grads[0]"),
        ("aliasing", lambda a, k: a.__setitem__(2, [a[0][0]]), ValueError, "share memory"),
        ("list lengths", lambda a, k: a[1].append(a[1][0]), ValueError, "grads"),
        ("sparse grad", tensor(1, lambda g: g.to_sparse()), TypeError, "sparse"),
        ("step 0", hp("step", 0), ValueError, "step"),
        ("step negative", hp("step", -3), ValueError, "step"),
        ("step float", hp("step", 2.0), TypeError, "step"),
        ("lr nan", hp("lr", float("nan")), ValueError, "lr"),
        ("lr negative", hp("lr", -1e-3), ValueError, "lr"),
        ("beta1 one", hp("beta1", 1.0), ValueError, "beta1"),
        ("beta2 inf", hp("beta2", float("inf")), ValueError, "beta2"),
        ("eps nan", hp("eps", float("nan")), ValueError, "eps"),
        ("wd negative", hp("weight_decay", -0.1), ValueError, "weight_decay"),
        ("decay <= 0", hp("weight_decay", 2000.0), ValueError, "weight_decay"),
        ("grad_scale inf", hp("grad_scale", float("inf")), ValueError, "grad_scale"),
        ("adamw_mode int", hp("adamw_mode", 1), TypeError, "adamw_mode"),
        ("threads 0", hp("threads", 0), ValueError, "threads"),
        ("sr_seed negative", hp("sr_seed", -1), ValueError, "sr_seed"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rollback", [False, True])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_rejected_and_nothing_modified(impl, rollback, case):
    name, mutate, exc, fragment = case
    s = make_state(1000, seed=1)
    args = [[s.p], [s.g], [s.m], [s.v]]
    kw = step_kwargs()
    mutate(args, kw)
    snapshot = [t.clone() for t in (s.p, s.g, s.m, s.v)]
    fn = impl.adam_rollback_multi if rollback else impl.adam_step_multi
    with pytest.raises(exc, match=re.escape(fragment)):
        fn(*args, **kw)
    for before, now in zip(snapshot, (s.p, s.g, s.m, s.v)):
        assert torch.equal(before, now)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_low_precision_copy(impl):
    s = make_state(100, lp_dtype=torch.float32)
    with pytest.raises(TypeError, match="params_lp"):
        impl.adam_step_multi([s.p], [s.g], [s.m], [s.v], params_lp=[s.lp], **step_kwargs())
    s = make_state(100)
    with pytest.raises(ValueError, match="params_lp"):
        impl.adam_step_multi([s.p], [s.g], [s.m], [s.v],
                             params_lp=[torch.zeros(99, dtype=torch.bfloat16)], **step_kwargs())


def test_rollback_needs_positive_betas():
    s = make_state(10)
    with pytest.raises(ValueError, match="beta1"):
        K.adam_rollback(s.p, s.g, s.m, s.v, **step_kwargs(beta1=0.0))


def test_grad_stats_rejects_mixed_or_bad_grads():
    with pytest.raises(TypeError, match="grads"):
        K.grad_stats_multi([torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="grads\\[0\\]"):
        K.grad_stats(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        K.grad_stats(torch.zeros(4, 4).t())
