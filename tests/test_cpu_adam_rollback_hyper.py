"""``so.CPUAdam.rollback()`` undoes the last step with that step's own hyper-parameters, even
after a scheduler (or the user) changed the group in between: lr, betas, eps, weight_decay,
adamw_mode, maximize. Checked by value: back to the pre-step state within a few fp32 ulps
(the inverse, DESIGN.md §4), where an undo with the new values would land far off."""

from __future__ import annotations

import pytest
import torch

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(**kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256))
    opt = so.CPUAdam([{"params": [w]}], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, **kw)
    for _ in range(3):  # warm moments, so the inverse is well inside its bound
        w.grad = torch.randn(256)
        opt.step()
    w.grad = torch.randn(256)
    state = opt.state[w]
    before = (w.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
              float(state["step"]))
    opt.step()
    return w, opt, before


def _back_to(w, opt, before, atol):
    st = opt.state[w]
    assert float(st["step"]) == before[3]
    for got, want in zip((w.detach(), st["exp_avg"], st["exp_avg_sq"]), before[:3]):
        assert torch.allclose(got, want, rtol=1e-5, atol=atol), float((got - want).abs().max())


@pytest.mark.parametrize(("key", "value"), [
    ("lr", 0.5), ("betas", (0.5, 0.9)), ("eps", 1e-2), ("weight_decay", 0.9),
    ("adamw_mode", False), ("maximize", True),
])
def test_rollback_uses_the_steps_own_hyper_parameters(key, value):
    w, opt, before = _setup()
    opt.param_groups[0][key] = value  # a scheduler step between step() and rollback()
    opt.rollback()
    _back_to(w, opt, before, atol=1e-7)
    # the new value applies from the next step on
    w2, opt2, _ = _setup()
    opt2.param_groups[0][key] = value
    opt.step()
    opt2.rollback()
    opt2.step()
    assert torch.equal(w.detach(), w2.detach())


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_an_lr_scheduler_between_step_and_rollback():
    """The issue's case: StepLR(gamma=0.01) stepped, then rollback(): the undo is exact."""
    w, opt, before = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.01)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    opt.rollback()
    _back_to(w, opt, before, atol=1e-7)
