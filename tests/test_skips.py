"""Skipped steps are said out loud (runtime/skips.py).

* ``eps <= 0`` is refused where the engine reads the param groups (kernels/hyper.py
  ``hypers_of``: at ``initialize`` and at the step after a change), naming the field: with
  ``eps=0`` the engine used to skip every step without a word (6 of 6 on the tiny GPT, whose
  unused embedding rows make 0/0), where torch writes NaN. The kernel and ``CPUAdam`` keep
  torch's maths (tests/test_kernel_prepared.py).
* A run that skips ``SKIP_STREAK`` steps in a row for a reason fp16's loss scale does not
  explain warns once (``SkippedSteps``), naming the cause and the buckets; the streak is
  ``EngineStats.skip_streak`` and the ``skip_streak`` scalar, 0 again after a step that ran.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _engine_ref import HYPER, cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime.skips import SKIP_STREAK, SkippedSteps

pytestmark = pytest.mark.usefixtures("one_thread")


def masters(engine: object) -> dict[str, torch.Tensor]:
    return engine.master_weights()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("eps", [0.0, -0.0])
def test_eps_zero_is_refused_at_initialize_naming_the_field(eps: float) -> None:
    with pytest.raises(ValueError) as refused:
        so.initialize(make_model(), {**HYPER, "eps": eps}, cpu_config())
    assert str(refused.value) == (
        f"optimizer.param_groups[0]['eps']={eps!r}: the engine needs eps > 0. With eps=0 Adam "
        "divides 0 by 0 for every element whose gradient has been 0 so far (torch writes NaN "
        "into those weights); the engine never writes a non-finite state, so it would skip "
        "every such step. Use a small positive eps (torch's default is 1e-8)")


def test_eps_set_to_zero_mid_run_is_refused_at_the_next_step_and_changes_nothing() -> None:
    model, data = make_model(), batches(3)
    with so.initialize(model, [{"params": list(model.parameters()), **HYPER}],
                       cpu_config(ratio=0.5)) as engine:
        engine.backward(model(*data[0]))
        engine.step()
        engine.zero_grad()
        before = masters(engine)
        engine.optimizer.param_groups[0]["eps"] = 0.0  # as a scheduler or a user may
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]=0.0"):
            engine.backward(model(*data[1]))
        engine.optimizer.param_groups[0]["eps"] = 1e-8
        assert all(torch.equal(before[k], v) for k, v in masters(engine).items())
        engine.backward(model(*data[1]))  # and it trains on
        engine.step()
        assert engine.stats.iterations == 2 and engine.stats.skipped_steps == 0


def run(model: torch.nn.Module, config: so.OffloadConfig, losses: list[float],
        hyper: dict | None = None, transform=None):
    """One step per entry; the batch loss times the entry (nan: a non-finite gradient).
    Returns (the streak after each step, the SkippedSteps warnings, telemetry, stats)."""
    data = batches(len(losses))
    streaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with so.initialize(model, dict(hyper or HYPER), config) as engine:
            if transform is not None:
                engine.register_grad_transform(transform)
            for (x, y), factor in zip(data, losses):
                engine.backward(model(x, y) * factor)
                engine.step()
                engine.zero_grad()
                streaks.append(engine.stats.skip_streak)
            scalars = [s.value for s in engine.telemetry.scalars("skip_streak")]
            notes = [(n.iteration, n.text) for n in engine.telemetry.notes()]
            stats = engine.stats
    said = [str(w.message) for w in caught if issubclass(w.category, SkippedSteps)]
    return streaks, said, scalars, notes, stats


NAN = float("nan")


def test_a_run_of_non_finite_gradients_says_so_once_per_streak() -> None:
    assert SKIP_STREAK == 3
    losses = [1.0, NAN, NAN, NAN, NAN, 1.0, NAN, NAN, 1.0, NAN, NAN, NAN]
    streaks, said, scalars, notes, stats = run(make_model(), cpu_config(ratio=0.5), losses)
    assert streaks == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert scalars == [float(s) for s in streaks]
    assert stats.skipped_steps == 9
    assert len(said) == 2  # the first streak at its third skip, the last one at its third
    first = said[0]
    assert "skipped 3 steps in a row (iterations 1-3)" in first
    assert "a non-finite gradient in buckets" in first
    assert "inf/nan in the loss" in first and "before iteration 1" in first
    assert "(iterations 9-11)" in said[1]
    assert [it for it, text in notes if text == first] == [3]  # the same note, at its end


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_the_streak_names_the_bucket_and_its_first_parameter(ratio: float) -> None:
    """ratio 0: every bucket a GPU tail one (their statistics come summed, so the cause is
    found per bucket); 1: every bucket offloaded (each has its own statistics)."""
    model = make_model()
    cfg = cpu_config(ratio=ratio)
    poisoned = "blocks.1.fc1.weight"
    with so.initialize(model, dict(HYPER), cfg) as probe:
        names = probe.state.names
        bucket = next(b for b in probe.bucket_plan.buckets
                      if poisoned in [names[i] for i in b.param_indices])
        first = names[bucket.param_indices[0]]

    def poison(name: str, grad: torch.Tensor) -> None:  # one parameter's gradient only
        if name == poisoned:
            grad.fill_(NAN)

    _, said, _, _, stats = run(make_model(), cfg, [1.0] * 3, transform=poison)
    assert stats.skipped_steps == 3 and len(said) == 1
    # that bucket alone, named by its first parameter
    assert f"a non-finite gradient in bucket {bucket.id} ({first!r}...)." in said[0]


def test_a_step_that_would_overflow_the_state_is_named_as_such() -> None:
    """Gradients of ~1e21 without clipping: (1-b2) g^2 overflows fp32 on every step."""
    def huge(name: str, grad: torch.Tensor) -> None:
        grad.mul_(1e21)

    _, said, _, _, stats = run(make_model(), cpu_config(ratio=0.5), [1.0] * 4,
                               transform=huge)
    assert stats.skipped_steps == 4 and stats.skip_streak == 4
    assert len(said) == 1
    assert "a step that would make the optimizer state non-finite in bucket" in said[0]
    assert "a non-finite gradient" not in said[0]
    assert "lower the learning rate or clip" in said[0]


def test_fp16_loss_scale_skips_are_not_a_streak_until_the_scale_is_at_its_minimum() -> None:
    """Dynamic scale 16, halved on every overflow (hysteresis 1) down to 2: the skips at 16,
    8 and 4 are the scale finding its level; at the minimum they count."""
    cfg = cpu_config(ratio=0.5, initial_scale_power=4, hysteresis=1, min_loss_scale=2.0)
    streaks, said, _, _, stats = run(make_model(dtype=torch.float16), cfg, [NAN] * 6)
    assert stats.skipped_steps == 6
    assert streaks == [0, 0, 0, 1, 2, 3]
    assert len(said) == 1 and "(iterations 3-5)" in said[0]


def test_the_message_by_hand() -> None:
    """Every clause of the message, exactly: the iterations, each cause with its first three
    buckets (and how many more), the advice for each cause, another rank's."""
    from superoffload.runtime.skips import GRADIENT, STATE, Cause, streak_message

    grads = [Cause(GRADIENT, b, f"p{b}") for b in range(5)]
    head = ("the engine skipped 3 steps in a row (iterations 7-9), "
            "not because of fp16's loss scale: ")
    nan_advice = ("look for inf/nan in the loss and the data (a log of 0, a division by zero, a "
                  "learning rate that diverged: engine.grad_norm() is inf)")
    state_advice = ("lower the learning rate or clip (max_grad_norm): (1-b2) g^2 overflows fp32 "
                    "or the update leaves its range")
    assert streak_message(3, 9, grads) == (
        head + "a non-finite gradient in buckets 0 ('p0'...), 1 ('p1'...), 2 ('p2'...) and 2 "
        "more. The weights are still those from before iteration 7; " + nan_advice)
    assert streak_message(3, 9, grads[:3] + [Cause(STATE, 6, "q")]) == (
        head + "a non-finite gradient in buckets 0 ('p0'...), 1 ('p1'...), 2 ('p2'...); a step "
        "that would make the optimizer state non-finite in bucket 6 ('q'...). The weights are "
        "still those from before iteration 7; " + nan_advice + ", or " + state_advice)
    assert streak_message(3, 9, [Cause(STATE, 6, "q")]).endswith(
        "in bucket 6 ('q'...). The weights are still those from before iteration 7; "
        + state_advice)
    assert streak_message(4, 9, grads[:2]).startswith(
        "the engine skipped 4 steps in a row (iterations 6-9)")
    assert "in buckets 0 ('p0'...), 1 ('p1'...). The" in streak_message(3, 9, grads[:2])
    assert "2 ('p2'...) and 1 more. The" in streak_message(3, 9, grads[:4])
    assert streak_message(3, 9, []) == (
        head + "a non-finite gradient or state on another rank. The weights are still those "
        "from before iteration 7; " + nan_advice)
