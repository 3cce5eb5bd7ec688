"""What every framework integration takes from the engine (integrations/bridge.py), checked
without a framework: fast, each decision by value.

* ``engine_config``: the framework's clipping and accumulation become the engine's; a
  configuration that contradicts them is refused naming both settings; a DeepSpeed dict (or
  JSON file) is converted, its ``optimizer`` section refused; anything else is a TypeError.
* ``backward``: the framework's loss, already divided by the accumulation steps, is
  multiplied back (the same tensor when there is no accumulation).
* ``adam_hyper``: exactly the four hyper-parameters of a torch group, betas as floats.
* ``EngineMetrics``: tokens are booked to the iteration they train and reported with it,
  windows end one iteration before the newest, the counters and the last finite scalars.
* ``gradients_in_grad``: the gradients shown to a hook, and what it leaves behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import superoffload as so
from superoffload.config import ConfigError, OffloadConfig
from superoffload.ds_config import from_deepspeed
from superoffload.integrations.bridge import (
    METRIC_PREFIX,
    EngineMetrics,
    adam_hyper,
    backward,
    engine_config,
    gradients_in_grad,
)
from superoffload.telemetry.recorder import Recorder

NAMES = ("Trainer(clip)", "Trainer(accum)")
DS = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "bf16": {"enabled": True}}


# ---------------------------------------------------------------------------- engine_config
@pytest.mark.parametrize("clip, want", [(0.5, 0.5), (1e-3, 1e-3), (0, None), (0.0, None),
                                        (-1.0, None), (None, None)])
def test_the_frameworks_clipping_and_accumulation_become_the_engines(clip: Any,
                                                                     want: float | None) -> None:
    got = engine_config(None, max_grad_norm=clip, grad_accum_steps=3, names=NAMES)
    assert got == OffloadConfig().replace(max_grad_norm=want, grad_accum_steps=3)
    assert isinstance(got.max_grad_norm, float | type(None))


def test_an_offload_config_keeps_its_fields_and_may_repeat_the_frameworks() -> None:
    base = OffloadConfig(ratio=0.25, bucket_bytes=8192)
    assert engine_config(base, max_grad_norm=None, grad_accum_steps=2, names=NAMES) == \
        base.replace(grad_accum_steps=2)
    same = base.replace(max_grad_norm=0.5, grad_accum_steps=2)
    assert engine_config(same, max_grad_norm=0.5, grad_accum_steps=2, names=NAMES) == same
    off = base.replace(max_grad_norm=0.0)  # 0 is off, as the framework's 0
    assert engine_config(off, max_grad_norm=None, grad_accum_steps=1, names=NAMES) == \
        base.replace(max_grad_norm=None)


def test_contradictions_name_both_settings() -> None:
    with pytest.raises(ConfigError) as clip:
        engine_config(OffloadConfig(max_grad_norm=2.0), max_grad_norm=1.0, grad_accum_steps=1,
                      names=NAMES)
    assert str(clip.value) == (
        "OffloadConfig.max_grad_norm=2.0 contradicts Trainer(clip)=1.0: the engine clips with "
        "the framework's value; set Trainer(clip)=2.0 and leave OffloadConfig.max_grad_norm "
        "unset")
    with pytest.raises(ConfigError, match=r"max_grad_norm=2.0 contradicts Trainer\(clip\)=None"):
        engine_config(OffloadConfig(max_grad_norm=2.0), max_grad_norm=None, grad_accum_steps=1,
                      names=NAMES)
    with pytest.raises(ConfigError) as accum:
        engine_config(OffloadConfig(grad_accum_steps=4), max_grad_norm=None, grad_accum_steps=2,
                      names=NAMES)
    assert str(accum.value) == (
        "OffloadConfig.grad_accum_steps=4 contradicts Trainer(accum)=2: set Trainer(accum) and "
        "leave grad_accum_steps at 1")


@pytest.mark.filterwarnings("ignore:DeepSpeed config")
def test_a_deepspeed_dict_or_file_is_converted_and_its_optimizer_refused(tmp_path: Path) -> None:
    want = from_deepspeed(DS)[0].replace(max_grad_norm=1.0, grad_accum_steps=2)
    assert engine_config(DS, max_grad_norm=1.0, grad_accum_steps=2, names=NAMES) == want
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    for given in (str(path), path):
        assert engine_config(given, max_grad_norm=1.0, grad_accum_steps=2, names=NAMES) == want
    with pytest.raises(ConfigError) as refused:
        engine_config({**DS, "optimizer": {"type": "AdamW"}}, max_grad_norm=None,
                      grad_accum_steps=1, names=NAMES)
    assert str(refused.value) == (
        "DeepSpeed config key 'optimizer': the training framework's own arguments set the "
        "learning rate, betas, eps and weight decay here; remove the section")
    with pytest.raises(TypeError) as wrong:
        engine_config(3, max_grad_norm=None, grad_accum_steps=1, names=NAMES)  # type: ignore[arg-type]
    assert str(wrong.value) == ("offload config: pass an OffloadConfig or a DeepSpeed-style "
                                "dict, not int")


# ---------------------------------------------------------------------------- backward, groups
class Recording:
    def __init__(self, steps: int) -> None:
        self.config = SimpleNamespace(grad_accum_steps=steps)
        self.losses: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)


def test_backward_multiplies_the_frameworks_division_back() -> None:
    loss = torch.tensor(0.75)
    one, three = Recording(1), Recording(3)
    backward(one, loss)
    backward(three, loss / 3)
    assert one.losses[0] is loss  # no accumulation: the tensor itself
    assert float(three.losses[0]) == pytest.approx(0.75, rel=1e-7)


def test_adam_hyper_takes_the_four_hyper_parameters_and_the_mode() -> None:
    group = {"params": [torch.zeros(1)], "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6,
             "weight_decay": 0.1, "initial_lr": 5.0, "foreach": None, "amsgrad": False}
    got = adam_hyper(group, adamw=False)
    assert got == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1,
                   "adamw_mode": False}
    assert type(got["betas"]) is tuple and all(type(b) is float for b in got["betas"])
    assert adam_hyper({"lr": 2.0}, adamw=True) == {"lr": 2.0, "adamw_mode": True}
    assert adam_hyper({"betas": (torch.tensor(0.5), 1)}, adamw=True)["betas"] == (0.5, 1.0)


# ---------------------------------------------------------------------------- EngineMetrics
def record(rec: Recorder, it: int, t0: float, wall: float) -> None:
    """One iteration of `wall` seconds: a forward and a backward, one gradient copy."""
    rec.add("device_compute", "forward", t0, t0 + wall / 2, iteration=it)
    rec.add("device_compute", "backward", t0 + wall / 2, t0 + wall, iteration=it)
    rec.add("d2h", "d2h", t0 + wall / 2, t0 + wall * 0.75, iteration=it, bucket=0, nbytes=1000)


def fake_engine() -> SimpleNamespace:
    """What EngineMetrics reads; no ``iteration`` yet (a framework may count before it)."""
    return SimpleNamespace(telemetry=Recorder(), stats=SimpleNamespace(
        rollbacks=1, replays=2, clipped_steps=3, skipped_steps=4))


def test_tokens_go_with_the_iteration_they_train_and_the_window_ends_before_the_newest() -> None:
    engine = fake_engine()
    logged = EngineMetrics(engine)
    logged.add_tokens(1)  # before the engine has an iteration: iteration 0's
    walls = {0: 1.0, 1: 2.0, 2: 4.0, 3: 8.0}
    t = 0.0
    for it in range(4):
        engine.iteration = it
        logged.add_tokens(10 ** (it + 1))
        logged.add_tokens(10 ** (it + 1))  # two micro-batches
        record(engine.telemetry, it, t, walls[it])
        t += walls[it]
        if it == 1:  # iteration 1 is the newest: only 0 is complete
            first = logged.collect()
    assert first[METRIC_PREFIX + "window_iterations"] == 1.0
    assert first[METRIC_PREFIX + "tokens_per_s"] == pytest.approx(21 / 1.0)
    assert first[METRIC_PREFIX + "iteration_ms"] == pytest.approx(1e3)
    second = logged.collect()  # 1 and 2 complete, 3 the newest
    assert second[METRIC_PREFIX + "window_iterations"] == 2.0
    assert second[METRIC_PREFIX + "tokens_per_s"] == pytest.approx((200 + 2000) / 6.0)
    assert second[METRIC_PREFIX + "iteration_ms"] == pytest.approx(3e3)
    assert METRIC_PREFIX + "window_iterations" not in logged.collect()  # nothing new complete
    for name, value in (("rollbacks", 1), ("replays", 2), ("clipped_steps", 3),
                        ("skipped_steps", 4)):
        assert second[METRIC_PREFIX + name] == value


def test_the_newest_finite_scalars_are_logged() -> None:
    engine = fake_engine()
    logged = EngineMetrics(engine)
    assert METRIC_PREFIX + "grad_norm" not in logged.collect()  # none recorded yet: left out
    for it, norm in enumerate((3.0, 2.0, 1.0)):
        engine.telemetry.scalar("grad_norm", it, norm)
        engine.telemetry.scalar("loss_scale", it, 2.0 ** (10 - it))
    out = logged.collect()
    assert out[METRIC_PREFIX + "grad_norm"] == 1.0 and out[METRIC_PREFIX + "loss_scale"] == 2.0 ** 8
    assert logged.last_scalar("grad_norm") == 1.0 and logged.last_scalar("nothing") is None
    engine.telemetry.scalar("grad_norm", 3, float("inf"))  # a skipped step: not logged
    assert METRIC_PREFIX + "grad_norm" not in logged.collect()


# ---------------------------------------------------------------------------- gradients_in_grad
def test_gradients_shown_to_a_hook_and_taken_back() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
    with so.initialize(model, {"lr": 1e-3}, cfg) as engine:
        with gradients_in_grad(engine):  # before any backward: nothing final to show
            assert all(p.grad is None for p in model.parameters())
        engine.backward(model(torch.randn(8, 32)).square().mean())
        freed = [id(p) for p in model.parameters() if p.grad is None]
        assert len(freed) == 4  # two layers offloaded, two in the GPU tail
        with gradients_in_grad(engine):
            for p in model.parameters():
                assert p.grad is not None and p.grad.dtype == p.dtype
                torch.testing.assert_close(p.grad, engine.full_grad(p))
        assert [id(p) for p in model.parameters() if p.grad is None] == freed
        engine.step()


@pytest.mark.parametrize("edit", ["in place", "replaced"])
def test_a_shown_gradient_edited_in_the_hook_is_left_for_step_to_refuse(edit: str) -> None:
    from superoffload.runtime.contract import GradientEdited

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
    with so.initialize(model, {"lr": 1e-3}, cfg) as engine:
        engine.backward(model(torch.randn(8, 32)).square().mean())
        last = model[3].weight  # offloaded (the last layer's gradient arrives first)
        assert last.grad is None
        with gradients_in_grad(engine):
            if edit == "in place":
                last.grad.mul_(0.5)
            else:
                last.grad = last.grad * 0.5
        assert last.grad is not None
        with pytest.raises(GradientEdited, match="3.weight"):
            engine.step()
