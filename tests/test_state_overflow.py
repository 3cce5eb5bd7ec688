"""Large learning rates: the second moment as torch computes it, and a step that would make
the optimizer state non-finite counted as a non-finite step (runtime/state_overflow.py).

At lr 1e3 an MLP without normalization reaches gradients of ~3e20: g*g overflows fp32 (3.4e38)
where torch's ((1-b2)*g)*g does not, so the kernel must multiply in torch's order (checked by
value against torch.optim.AdamW, whose two implementations agree to ~7e-7 there). Beyond
~5.8e20, (1-b2)*g*g overflows in torch too: torch writes inf into exp_avg_sq and the weight
never moves again; the engine reports the bucket and skips the step on every bucket, as for a
non-finite gradient (checked against AdamW that skips such steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_ref import cpu_config
from _kernel_support import bits

import superoffload as so
from superoffload.kernels import torch_ref
from superoffload.runtime.state_overflow import may_overflow

pytestmark = pytest.mark.usefixtures("one_thread")
BIG_LR = {"lr": 1e3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def mlp(seed: int, width: int) -> torch.nn.Sequential:
    """Four layers, one tanh: at lr 1e3 its gradients grow to ~1e19-1e22 within 8 steps."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Linear(width, width),
                               torch.nn.Linear(width, 1))


def data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def torch_run(model: torch.nn.Module, batches, *, skip_nonfinite_state: bool = False,
              **opt_kw) -> tuple[dict[str, torch.Tensor], int, list[float]]:
    """AdamW; with ``skip_nonfinite_state`` a step that leaves p, m or v non-finite is undone
    (what the engine does). Returns (weights, skipped steps, max |grad| per step)."""
    opt = torch.optim.AdamW(model.parameters(), **{**BIG_LR, **opt_kw})
    skipped, gmax = 0, []
    for batch in batches:
        loss(model, batch).backward()
        gmax.append(max(float(p.grad.abs().max()) for p in model.parameters()))
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        opt.step()
        opt.zero_grad()
        state = [t for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
        if skip_nonfinite_state and not all(bool(torch.isfinite(t).all())
                                            for t in [*state, *model.parameters()]):
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            skipped += 1
    return {n: p.detach().clone() for n, p in model.named_parameters()}, skipped, gmax


def engine_run(model: torch.nn.Module, batches, config: so.OffloadConfig, hyper=BIG_LR):
    with so.initialize(model, hyper, config) as engine:
        for batch in batches:
            engine.backward(loss(model, batch))
            engine.step()
            engine.zero_grad()
        return engine.master_weights(), copy.copy(engine.stats)


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference per tensor relative to that tensor's largest weight."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


# ------------------------------------------------------------------ the kernel's order
def test_second_moment_of_a_huge_gradient_is_finite_as_in_torch():
    """|g| up to 5e20: g*g is inf in fp32, ((1-b2)*g)*g is not; both backends, fused torch."""
    gen = torch.Generator().manual_seed(0)
    g = (torch.rand(4096, generator=gen) * 2 - 1) * 5e20
    p, m, v = torch.randn(4096, generator=gen), torch.zeros(4096), torch.zeros(4096)
    assert not bool(torch.isfinite(g * g).all())  # the order matters here
    ref_p = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref_p], **BIG_LR, fused=True)
    ref_p.grad = g.clone()
    opt.step()
    outs = []
    for backend in (so.kernels, torch_ref):
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        step = backend.adam_step_multi if backend is torch_ref else None
        if step is None:
            so.kernels.adam_step(pp, g, mm, vv, step=1, lr=1e3, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.0)
        else:
            step([pp], [g], [mm], [vv], step=1, lr=1e3, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0)
        assert bool(torch.isfinite(vv).all())
        # torch's fused kernel multiplies in this order too: the same bits
        assert torch.equal(vv, opt.state[ref_p]["exp_avg_sq"])
        assert torch.allclose(pp, ref_p.detach(), rtol=1e-6, atol=1e-3)
        outs.append((pp, mm, vv))
    for a, b in zip(*outs):  # C kernel == torch fallback, bit for bit
        assert torch.equal(bits(a), bits(b))
    # and the inverse subtracts the very product the step added
    pp, mm, vv = outs[0]
    so.kernels.adam_rollback(pp, g, mm, vv, step=1, lr=1e3, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=0.0)
    assert torch.equal(vv, v) and torch.allclose(pp, p, atol=1e-3)


@pytest.mark.parametrize("seed", [2, 3])
def test_engine_at_lr_1e3_matches_torch(seed):
    """Gradients reach 4e19-3e20 (torch's v stays finite): the engine ends within 1e-4 of
    AdamW relative to each tensor's largest weight (measured 1e-5; the old order: 0.4-0.7),
    nothing reported non-finite, host and device-tail buckets alike."""
    batches = data()
    ref, skipped, gmax = torch_run(mlp(seed, 8), batches)
    assert skipped == 0 and max(gmax) > 2e19  # the regime of the bug
    for ratio in (0.0, 1.0):
        w, stats = engine_run(mlp(seed, 8), batches, cpu_config(ratio=ratio))
        assert rel_err(w, ref) < 1e-4, ratio
        assert stats.nonfinite_buckets == 0 and stats.skipped_steps == 0


# ------------------------------------------------------------------ a non-finite state
def test_may_overflow_is_a_bound_of_the_step():
    h = so.kernels.AdamHyper(lr=1e3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert not may_overflow(1e38, 1.0, [h])           # |g| <= 1e19: (1-b2) g^2 ~ 1e35
    assert may_overflow(1e42, 1.0, [h])               # |g| may be 1e21: (1-b2) g^2 > 3.4e38
    assert not may_overflow(1e42, 1e-3, [h])          # the scale enters
    assert may_overflow(0.0, 1.0, [so.kernels.AdamHyper(1e-3, 0.9, 0.999, 0.0, 0.0)])  # eps 0
    # and it is a bound: a step under it never overflows, whatever v was
    g = torch.full((4,), (1.7e38 / 4) ** 0.5)  # G^2 = half of fp32's maximum
    assert not may_overflow(float(g.double().square().sum()), 1.0, [h])
    p, m, v = torch.zeros(4), torch.zeros(4), torch.full((4,), 3.4e38)
    so.kernels.adam_step(p, g, m, v, step=5, lr=1e3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert bool(torch.isfinite(v).all())


@pytest.mark.parametrize("config", [
    dict(speculation="on", rollback="auto"), dict(speculation="on", rollback="inverse"),
    dict(speculation="on", rollback="snapshot"), dict(speculation="off"),
], ids=lambda c: "-".join(c.values()))
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_step_that_overflows_the_state_is_skipped_like_a_nonfinite_gradient(config, ratio):
    """Width 32 (three buckets): gradients of ~6e21-9e21 from step 3 on, (1-b2) g^2 overflows
    in torch too. Every such step is skipped on every bucket (the others rolled back) and
    reported; the weights match AdamW that undoes each step leaving a non-finite state (1e-5
    relative, measured 1e-7-2e-7), and no state is ever non-finite."""
    batches = data()
    ref, skipped, gmax = torch_run(mlp(0, 32), batches, skip_nonfinite_state=True)
    assert skipped >= 1 and max(gmax) > 1e21
    model = mlp(0, 32)
    with so.initialize(model, BIG_LR, cpu_config(ratio=ratio, **config)) as engine:
        for batch in batches:
            engine.backward(loss(model, batch))
            engine.step()
            engine.zero_grad()
        w = engine.master_weights()
        states = engine.export_states()
        stats = engine.stats
        notes = " ".join(n.text for n in engine.telemetry.notes())
    assert stats.skipped_steps == skipped and stats.nonfinite_buckets >= skipped
    assert "optimizer state non-finite" in notes
    assert all(bool(torch.isfinite(t).all()) for s in states.values()
               for t in (s.master, s.exp_avg, s.exp_avg_sq))
    assert rel_err(w, ref) < 1e-5


def test_clipping_makes_a_huge_gradient_harmless():
    """With max_grad_norm the step that runs is the clipped one: gradients scaled to ~1e21
    (a grad transform, lr 1e-3) skip nothing although the unclipped step would overflow, and
    the run matches AdamW after clipping by the global norm (1e-5 relative). That norm is
    taken in fp64, as the engine does: torch's clip_grad_norm_ squares in fp32, returns inf
    past 1.8e19 and zeroes the gradients instead (docs/failure_semantics.md)."""
    hyper = {**BIG_LR, "lr": 1e-3}
    batches = data()
    model, gmax = mlp(0, 32), []
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    for batch in batches:
        loss(model, batch).backward()
        grads = [p.grad.mul_(1e22) for p in model.parameters()]
        gmax.append(max(float(g.abs().max()) for g in grads))
        norm = float(sum(g.double().square().sum() for g in grads)) ** 0.5
        for g in grads:  # clip_grad_norm_'s coefficient, from the fp64 norm
            g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
        opt.step()
        opt.zero_grad()
    assert min(gmax) > 1e21
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    for config in (dict(speculation="on", rollback="inverse"), dict(speculation="off")):
        model = mlp(0, 32)
        with so.initialize(model, hyper, cpu_config(ratio=0.5, max_grad_norm=1.0,
                                                    **config)) as engine:
            engine.register_grad_transform(lambda name, g: g.mul_(1e22))
            for batch in batches:
                engine.backward(loss(model, batch))
                engine.step()
                engine.zero_grad()
            w, stats = engine.master_weights(), engine.stats
        assert stats.skipped_steps == 0 and stats.nonfinite_buckets == 0
        assert stats.clipped_steps == len(batches)
        assert rel_err(w, ref) < 1e-5
