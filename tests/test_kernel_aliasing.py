"""Partly overlapping buffers are refused by memory range, not identity (docs/kernel.md, "Memory
overlap").

Each refused case checks that nothing was modified; grads that alias each other are
allowed (the kernel only reads them, kernels/checks.py) and give the same bits as copies.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_support import step_kwargs

import superoffload.kernels as K
from superoffload.kernels import torch_ref

IMPLS = [pytest.param(torch_ref, id="torch")]
if K.backend() == "cffi":
    from superoffload.kernels import cpu_adam

    IMPLS.insert(0, pytest.param(cpu_adam, id="cffi"))

N = 1000


def _bytes(numel_bytes: int) -> torch.Tensor:
    return torch.randn(numel_bytes // 4).abs_().view(torch.uint8)


def _fresh(n: int = N) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]


def _moments_at_offsets():
    p, g, _, _ = _fresh()
    buf = torch.rand(2 * N) * 0.01
    m, v = buf[:N], buf[N // 2: N // 2 + N]  # distinct data_ptr, half of them shared
    return [p], [g], [m], [v], None


def _lp_overlaps_param_by_one_element():
    raw = _bytes(4 * N + 2 * N)
    p = raw[: 4 * N].view(torch.float32)
    # its first element = p's last 2 bytes
    lp = raw[4 * N - 2: 4 * N - 2 + 2 * N].view(torch.bfloat16)
    _, g, m, v = _fresh()
    return [p], [g], [m], [v], [lp]


def _same_param_twice():
    a, b = _fresh(), _fresh()
    return [a[0], a[0]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], None


def _grad_is_a_moment():
    a, b = _fresh(), _fresh()
    return [a[0], b[0]], [a[1], a[2]], [a[2], b[2]], [a[3], b[3]], None  # grads[1] is exp_avgs[0]


def _params_are_views_of_one_storage():
    buf = torch.randn(2 * N)
    a, b = _fresh(), _fresh()
    return [buf[:N], buf[N - 1: 2 * N - 1]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], None


def _grad_overlaps_a_param_view():
    buf = torch.randn(N + N // 2)
    a = _fresh()
    return [buf[:N]], [buf[N // 2:]], [a[2]], [a[3]], None


def _exp_avg_sq_is_next_params_lp():
    a, b = _fresh(), _fresh()
    raw = _bytes(4 * N)
    v0 = raw.view(torch.float32)
    lp1 = raw[: 2 * N].view(torch.bfloat16)  # first half of exp_avg_sqs[0]
    return ([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], [v0, b[3]],
            [torch.zeros(N, dtype=torch.bfloat16), lp1])


CASES = [
    ("moments overlap at different offsets", _moments_at_offsets),
    ("bf16 params_lp overlaps the fp32 param by one element", _lp_overlaps_param_by_one_element),
    ("the same param twice in one call", _same_param_twice),
    ("grads[1] is exp_avgs[0]", _grad_is_a_moment),
    ("params are views of one storage at different offsets", _params_are_views_of_one_storage),
    ("a grad overlaps a param (views)", _grad_overlaps_a_param_view),
    ("exp_avg_sqs[0] overlaps params_lp[1]", _exp_avg_sq_is_next_params_lp),
]


def _snapshot(args) -> list[torch.Tensor]:
    """Raw bytes of every tensor (NaN-safe: reinterpreted buffers hold NaN patterns)."""
    return [t.view(torch.uint8).clone() for seq in args if seq is not None for t in seq]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rollback", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_overlapping_buffers_are_refused_and_nothing_is_modified(impl, rollback, case):
    _, make = case
    args = make()
    before = _snapshot(args)
    fn = impl.adam_rollback_multi if rollback else impl.adam_step_multi
    with pytest.raises(ValueError, match="share memory"):
        fn(*args[:4], params_lp=args[4], **step_kwargs())
    for was, now in zip(before, _snapshot(args)):
        assert torch.equal(was, now)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_prepare_refuses_overlap_too(case):
    args = case[1]()
    with pytest.raises(ValueError, match="share memory"):
        K.prepare_adam(*args[:4], params_lp=args[4])


def test_prepared_call_refuses_per_call_grads_that_alias_written_memory():
    a, b = _fresh(), _fresh()
    prep = K.prepare_adam([a[0], b[0]], None, [a[2], b[2]], [a[3], b[3]])
    before = _snapshot(([a[0], b[0]], [a[2], b[2]], [a[3], b[3]]))
    hyper = K.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grads\[1\] and exp_avgs\[0\] share memory"):
        prep.step(hyper, step=1, grads=[a[1], a[2][:N]])
    for was, now in zip(before, _snapshot(([a[0], b[0]], [a[2], b[2]], [a[3], b[3]]))):
        assert torch.equal(was, now)


@pytest.mark.parametrize("impl", IMPLS)
def test_grads_may_alias_each_other(impl):
    """Two params fed the same gradient tensor (read-only) = the same gradient as copies."""
    a, b = _fresh(), _fresh()
    a2, b2 = [t.clone() for t in a], [t.clone() for t in b]
    g = torch.randn(N)
    kw = step_kwargs(weight_decay=0.1)
    impl.adam_step_multi([a[0], b[0]], [g, g], [a[2], b[2]], [a[3], b[3]], **kw)
    impl.adam_step_multi([a2[0], b2[0]], [g.clone(), g.clone()], [a2[2], b2[2]], [a2[3], b2[3]],
                         **kw)
    for x, y in zip((a[0], b[0], a[2], b[3]), (a2[0], b2[0], a2[2], b2[3])):
        assert torch.equal(x, y)
    # and a grad that is a view into another grad is fine as well
    gbuf = torch.randn(N + 10)
    impl.adam_step_multi([a[0], b[0]], [gbuf[:N], gbuf[10:]], [a[2], b[2]], [a[3], b[3]], **kw)


def test_adjacent_views_that_only_touch_are_accepted():
    """Ranges are half-open: p = buf[:n], m = buf[n:2n] share a storage but no byte."""
    buf = torch.zeros(4 * N)
    p, m, v = buf[:N], buf[N: 2 * N], buf[2 * N: 3 * N]
    p.normal_()
    g = torch.randn(N)
    ref = [p.clone(), g.clone(), m.clone(), v.clone()]
    K.adam_step(p, g, m, v, **step_kwargs())
    K.adam_step(ref[0], ref[1], ref[2], ref[3], **step_kwargs())
    assert torch.equal(p, ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3])
