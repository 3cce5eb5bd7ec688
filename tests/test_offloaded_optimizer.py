"""A framework's torch optimizer the engine steps for (integrations/offloaded_optimizer.py): its
own step runs with nothing to apply, so its LR scheduler and its step hooks see each step the
engine took. Nothing writes torch's private state to pretend a step ran
(tests/test_architecture.py refuses another library's private attribute written anywhere).

Accelerate (an engine built from the script's `torch.optim.AdamW`) and Lightning (from
`configure_optimizers`): a step hook on that AdamW counts the engine's steps, the AdamW keeps
no state of its own, and torch does not warn that `lr_scheduler.step()` ran first."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from superoffload.integrations.offloaded_optimizer import step_without_gradients

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _counted(opt: torch.optim.Optimizer) -> list[int]:
    steps: list[int] = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    return steps


def test_a_step_without_gradients_applies_nothing_and_is_seen() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    steps = _counted(opt)
    model(torch.randn(2, 4)).square().sum().backward()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "lr_scheduler.step() before ..."
        step_without_gradients(opt)
        sched.step()
    assert steps == [1] and not opt.state  # seen, and no Adam state: nothing was applied
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))  # put back
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_accelerate_the_scripts_adamw_sees_each_engine_step() -> None:
    pytest.importorskip("accelerate", reason="needs the 'hf' extra (accelerate)")
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")
    import test_integrations_accelerate as acc_tests

    acc = acc_tests.accelerator(True)
    model = acc_tests.make_model()
    opt = torch.optim.AdamW(model.parameters(), **acc_tests.HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    steps = _counted(opt)
    model, prepared, data, sched = acc.prepare(model, opt, acc_tests.loader(), sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "lr_scheduler.step() before ..."
        acc_tests.train(acc, model, prepared, data, sched)
    assert acc.engine.stats.iterations == acc_tests.STEPS == len(steps)
    assert not opt.state  # the engine holds the moments; the AdamW applied nothing
    acc.free_memory()


def test_lightning_the_modules_adamw_sees_each_engine_step() -> None:
    pytest.importorskip("lightning.pytorch", reason="needs the optional 'lightning' extra")
    import test_integrations_lightning as pl_tests

    from superoffload.integrations.lightning import SuperOffloadStrategy

    class Counted(pl_tests.Module):
        def configure_optimizers(self) -> Any:
            out = super().configure_optimizers()
            self.adamw = out["optimizer"]
            self.steps = _counted(self.adamw)
            return out

    module = Counted()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pl_tests.fit(module, pl_tests.batches(pl_tests.STEPS * pl_tests.GAS),
                     strategy=SuperOffloadStrategy(pl_tests.ENGINE))
    assert len(module.steps) == pl_tests.STEPS
    assert not module.adamw.state  # the engine holds the moments
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)]
