"""CPUAdam keeps torch.optim's contracts (param groups, schedulers, zero_grad, state_dict
through torch.save) and matches torch.optim.AdamW/Adam on a tiny model; rollback undoes
the last step by value."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import superoffload as so


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd sizes so tensors straddle the per-thread split points
    return torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.GELU(), torch.nn.Linear(129, 5))


def _train(model, opt, steps: int, seed: int = 1, sched=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 37, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_optimizer_on_a_tiny_model(adamw_mode):
    """30 steps, two param groups (one without weight decay), a LR schedule: same params
    as torch.optim in float64 within 2e-6 (fp32 rounding over 30 steps of lr 1e-2)."""
    ours = _model()
    ref = copy.deepcopy(ours).double()

    def groups(m):
        return [{"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
                {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}]

    opt = so.CPUAdam(groups(ours), lr=1e-2, adamw_mode=adamw_mode, threads=2)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(groups(ref), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.5)
    _train(ours, opt, 30, sched=sched)
    _train(ref, ref_opt, 30, sched=ref_sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(a.double(), b, rtol=0, atol=2e-6)


def test_state_dict_round_trip_through_torch_save():
    model = _model()
    opt = so.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    twin = _model(seed=5)
    buf.seek(0)
    saved = torch.load(buf)
    twin.load_state_dict(saved["model"])
    opt2 = so.CPUAdam(twin.parameters(), lr=1e-3, weight_decay=0.01)
    opt2.load_state_dict(saved["opt"])
    _train(model, opt, 2, seed=9)
    _train(twin, opt2, 2, seed=9)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert float(opt2.state[next(twin.parameters())]["step"]) == 5.0


def test_loads_a_torch_adamw_state_dict():
    """Same state keys as torch.optim.AdamW: a run can switch optimizers mid-training."""
    model = _model()
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train(ref, torch_opt, 4)
    model.load_state_dict(ref.state_dict())
    opt = so.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    # deepcopy: load_state_dict keeps same-dtype tensors, the two would share moments
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _train(model, opt, 3, seed=2)
    _train(ref, torch_opt, 3, seed=2)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_rollback_restores_values_and_step_count():
    model = _model()
    opt = so.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 3)
    params = list(model.parameters())
    snap = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(),
             opt.state[p]["exp_avg_sq"].clone()) for p in params]
    model(torch.randn(4, 37)).sum().backward()
    g_max = [float(p.grad.abs().max()) for p in params]
    opt.step()
    assert not torch.equal(params[0], snap[0][0])
    opt.rollback()
    for p, (p0, m0, v0), g in zip(params, snap, g_max):
        st = opt.state[p]
        assert float(st["step"]) == 3.0
        assert torch.allclose(p, p0, rtol=4e-7, atol=1e-9)
        # the inverse subtracts (1-b1) g from m: judge it against the operands' size
        atol_m = 1e-6 * (float(m0.abs().max()) + 0.1 * g)
        assert torch.allclose(st["exp_avg"], m0, rtol=1e-6, atol=atol_m)
        atol_v = 1e-6 * (float(v0.max()) + 1e-3 * g * g)
        assert torch.allclose(st["exp_avg_sq"], v0, rtol=1e-6, atol=atol_v)
        assert bool((st["exp_avg_sq"] >= 0).all())
    with pytest.raises(RuntimeError, match="no step to undo"):
        opt.rollback()


def test_params_without_grad_are_left_alone():
    model = _model()
    opt = so.CPUAdam(model.parameters())
    model[0].weight.requires_grad_(False)
    before = model[0].weight.clone()
    _train(model, opt, 2)
    assert torch.equal(model[0].weight, before)
    assert model[0].weight not in opt.state


def test_rejects_what_it_does_not_support():
    with pytest.raises(ValueError, match="amsgrad"):
        so.CPUAdam(_model().parameters(), amsgrad=True)
    with pytest.raises(TypeError, match="float32"):
        so.CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="CPU"):
        so.CPUAdam([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="betas"):
        so.CPUAdam(_model().parameters(), betas=(0.9, 1.0))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = so.CPUAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


def test_closure_and_bf16_grads():
    p = torch.nn.Parameter(torch.ones(100))
    p.grad_dtype = None  # allow a bf16 .grad on an fp32 param (torch >= 2.9)
    opt = so.CPUAdam([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        p.grad = p.grad.to(torch.bfloat16)  # kernel reads bf16 grads directly
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 200.0
    assert torch.allclose(p, torch.full((100,), 0.9), atol=1e-6)
