"""torch's LR schedulers drive the engine whichever step a loop calls: ``engine.step()`` (where
the step is) and ``engine.optimizer.step()`` give the same learning rates and the same weights,
and neither makes torch warn that ``lr_scheduler.step()`` ran before ``optimizer.step()``
(``LRScheduler`` wraps ``optimizer.step`` to notice that it ran; ``engine.step()`` goes
through ``engine.optimizer.step()``, runtime/engine.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, cpu_config
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS = 4


def _train(step_with: str) -> tuple[dict[str, torch.Tensor], list[float], list[str]]:
    model = make_model()
    with so.initialize(model, dict(HYPER), cpu_config(ratio=0.5, max_grad_norm=1.0)) as engine:
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
        step: Any = engine.step if step_with == "engine" else engine.optimizer.step
        zero_grad: Any = engine.zero_grad if step_with == "engine" else engine.optimizer.zero_grad
        lrs = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in batches(STEPS):
                engine.backward(model(x, y))
                step()
                zero_grad()
                sched.step()
                lrs.append(engine.optimizer.param_groups[0]["lr"])
        weights = engine.master_weights()
    told = [str(w.message) for w in seen if "optimizer.step()" in str(w.message)]
    return weights, lrs, told


def test_engine_step_is_the_optimizer_step_lr_schedulers_expect() -> None:
    by_engine, lrs_engine, told_engine = _train("engine")
    by_optimizer, lrs_optimizer, told_optimizer = _train("optimizer")
    assert told_engine == [] and told_optimizer == []
    want = [HYPER["lr"] / (1 + k) for k in range(1, STEPS + 1)]
    assert lrs_engine == pytest.approx(want, rel=1e-12) and lrs_optimizer == lrs_engine
    assert by_engine.keys() == by_optimizer.keys()
    assert all(torch.equal(by_engine[k], by_optimizer[k]) for k in by_engine)


@pytest.mark.parametrize("step_with", ["engine", "optimizer"])
def test_step_hooks_run_once_per_step_whichever_step_the_loop_calls(step_with: str) -> None:
    """torch's ``register_step_pre_hook``/``register_step_post_hook`` run around every step,
    in the stepping thread, whether the loop calls ``engine.step()`` or
    ``engine.optimizer.step()``: the auto-calibration and the A/B trial listen there
    (runtime/step_listener.py), and the post hook sees the iteration already counted."""
    model = make_model()
    with so.initialize(model, dict(HYPER), cpu_config(ratio=0.5)) as engine:
        seen: list[tuple[str, int]] = []
        engine.optimizer.register_step_pre_hook(
            lambda opt, a, k: seen.append(("pre", engine.iteration)))
        engine.optimizer.register_step_post_hook(
            lambda opt, a, k: seen.append(("post", engine.iteration)))
        step: Any = engine.step if step_with == "engine" else engine.optimizer.step
        for x, y in batches(STEPS):
            engine.backward(model(x, y))
            step()
            engine.zero_grad()
    assert seen == [(when, k + (when == "post")) for k in range(STEPS) for when in ("pre", "post")]
