"""Speculation-then-validation: the pure verdict, the adaptive switch, the loss scaler, and
the engine's rollbacks checked by VALUES against the non-speculative schedule and PyTorch."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.stv import Action, AdaptiveSTV, verdict

STEPS = 12
BAD_STEPS = (3, 7)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ----------------------------------------------------------------- pure parts
def test_verdict_matches_clip_grad_norm():
    g = torch.tensor([3.0, 4.0])  # norm 5
    v = verdict(float((g * 8).square().sum()), 0, loss_scale=8.0, max_grad_norm=1.0)
    assert v.action is Action.CLIP and v.grad_norm == pytest.approx(5.0)
    clipped = g.clone()
    torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0)  # API smoke
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = clipped
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert torch.allclose(g * 8 * v.grad_scale, p.grad, rtol=1e-6)
    # clip_grad_norm_ divides by norm + 1e-6: at norm 5 that moves the coefficient by 2e-7,
    # below what rtol 1e-6 sees; at norm 5e-6 the coefficient is 1/6 instead of 1/5. Budget
    # rtol 1e-6, atol 0: two fp32 roundings (one product each side) are ~1e-7 relative
    tiny = torch.tensor([3e-6, 4e-6])
    v = verdict(float((tiny * 8).square().sum()), 0, loss_scale=8.0, max_grad_norm=1e-6)
    p.grad = tiny.clone()
    torch.nn.utils.clip_grad_norm_([p], 1e-6)
    assert v.action is Action.CLIP
    assert torch.allclose(tiny * 8 * v.grad_scale, p.grad, rtol=1e-6, atol=0.0)
    assert verdict(25.0, 0, loss_scale=1.0, max_grad_norm=10.0).action is Action.COMMIT
    assert verdict(25.0, 0, loss_scale=1.0, max_grad_norm=None).grad_scale == 1.0
    assert verdict(1.0, 3, loss_scale=1.0, max_grad_norm=1.0).action is Action.SKIP
    assert verdict(math.inf, 0, loss_scale=1.0, max_grad_norm=None).action is Action.SKIP


def test_adaptive_switches_off_and_on_with_notes():
    stv = AdaptiveSTV(mode="adaptive", window=4, threshold=0.25)
    notes = [stv.observe(c) for c in [False, False, False, True]]
    assert stv.enabled is True and notes == [None] * 4  # 1 of 4 is not above 25%
    note = stv.observe(True)
    assert stv.enabled is False and note is not None and "speculation off" in note
    notes = [stv.observe(False) for _ in range(4)]
    assert stv.enabled is True and any(n and "back on" in n for n in notes)
    fixed = AdaptiveSTV(mode="on", window=4, threshold=0.25)
    assert all(fixed.observe(True) is None for _ in range(8)) and fixed.enabled


def test_loss_scaler_deepspeed_semantics():
    s = LossScaler(dynamic=True, init_scale=2.0**4, scale_window=3, hysteresis=2, min_scale=2.0)
    seen = []
    for overflow in [True, True, True, False, False, False, True, True, True, True]:
        s.update(overflow)
        seen.append(s.loss_scale)
    # hysteresis 2: the first overflow is tolerated, later ones halve (never below 2);
    # 3 clean iterations double the scale and restore the hysteresis (DeepSpeed defaults)
    assert seen == [16, 8, 4, 4, 4, 8, 8, 4, 2, 2]
    static = LossScaler(dynamic=False, init_scale=128.0)
    static.update(True)
    assert static.loss_scale == 128.0


# ----------------------------------------------------------------- engine
class NanInjector:
    """Puts a NaN into one parameter's gradient on chosen steps (one bucket non-finite)."""

    def __init__(self, bad_steps):
        self.bad_steps, self.step, self.handle = set(bad_steps), -1, None

    def attach(self, model):
        def hook(grad):
            return grad * float("nan") if self.step in self.bad_steps else grad
        self.handle = model.blocks[-1].fc2.weight.register_hook(hook)

    def during(self, engine, step):
        self.step = step


cfg = functools.partial(cpu_config, ratio=0.5)


def run(config, *, dtype=torch.float32, bad=(), reference=False, during=None, hyper=HYPER):
    inj = NanInjector(bad)
    model = make_model(dtype=dtype)
    inj.attach(model)

    def hook(engine, step):
        inj.during(engine, step)
        return during(engine, step) if during else None

    data = batches(STEPS)
    if reference:
        return train_reference(model, data, steps=STEPS, max_norm=config.max_grad_norm,
                               during=hook, hyper=hyper), None
    return train_engine(model, data, config, steps=STEPS, during=hook, hyper=hyper)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_injected_nan_rolls_back_and_matches_reference(dtype):
    config = cfg(max_grad_norm=None)
    ref, _ = run(config, dtype=dtype, bad=BAD_STEPS, reference=True)
    got, st = run(config, dtype=dtype, bad=BAD_STEPS)
    assert max_diff(ref, got) < (1e-5 if dtype == torch.float32 else 1e-3)
    n_host = len(
        so.initialize(make_model(dtype=dtype), {}, config, inline=True).bucket_plan.host_buckets)
    assert st.skipped_steps == len(BAD_STEPS)
    assert st.nonfinite_buckets == len(BAD_STEPS)  # only the injected bucket is non-finite
    # every other offloaded bucket was speculated and then rolled back
    assert st.rollbacks == len(BAD_STEPS) * (n_host - 1)
    assert st.speculated_buckets == STEPS * n_host - len(BAD_STEPS)
    assert st.replays == 0


def test_forced_clipping_replays_and_matches_reference():
    # the rollback machinery itself: rollback="auto" would not speculate these buckets at all
    # (each alone is above max_grad_norm: clipping is certain; tests/test_auto_rollback.py)
    config = cfg(max_grad_norm=0.05, rollback="inverse")
    ref, _ = run(config, reference=True)
    got, st = run(config)
    assert max_diff(ref, got) < 1e-5
    n_host = len(so.initialize(make_model(), {}, config, inline=True).bucket_plan.host_buckets)
    assert st.clipped_steps == STEPS
    assert st.rollbacks == st.replays == STEPS * n_host


def test_auto_does_not_speculate_buckets_certain_to_clip():
    """Each bucket alone exceeds max_grad_norm=0.05: stepping it before the verdict could only
    be undone, so "auto" steps it once after the verdict (no rollback, no replay)."""
    off, _ = run(cfg(max_grad_norm=0.05, speculation="off"), bad=BAD_STEPS)
    auto, st = run(cfg(max_grad_norm=0.05, speculation="on"), bad=BAD_STEPS)
    assert st.rollbacks == 0 and st.replays == 0 and st.clipped_steps == STEPS - len(BAD_STEPS)
    for k in off:
        assert torch.equal(off[k], auto[k]), k


@pytest.mark.parametrize("bad", [(), BAD_STEPS])
def test_snapshot_rollback_is_bit_exact(bad):
    off, _ = run(cfg(max_grad_norm=0.05, speculation="off"), bad=bad)
    snap, st = run(cfg(max_grad_norm=0.05, speculation="on", rollback="snapshot"), bad=bad)
    assert st.rollbacks > 0
    for k in off:
        assert torch.equal(off[k], snap[k]), k


def test_inverse_rollback_close_to_non_speculative():
    off, _ = run(cfg(max_grad_norm=0.05, speculation="off"), bad=BAD_STEPS)
    inv, st = run(cfg(max_grad_norm=0.05, speculation="on", rollback="inverse"), bad=BAD_STEPS)
    assert st.rollbacks > 0 and max_diff(off, inv) < 1e-5


def test_adaptive_mode_switches_off_then_back_on():
    def during(engine, step):  # clip hard for 4 steps (warm-up), then never
        norm = 0.05 if step < 4 else 1e9
        if engine is not None:
            engine.reconfigure(max_grad_norm=norm)
        return norm

    config = cfg(speculation="adaptive", adaptive_window=4, adaptive_threshold=0.25,
                 max_grad_norm=0.05, rollback="inverse")  # "auto" would not speculate: certain
    ref, _ = run(config, reference=True, during=during)
    model = make_model()
    data = batches(STEPS)
    with so.initialize(model, dict(HYPER), config) as engine:
        for step, (x, y) in enumerate(data):
            during(engine, step)
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        kinds = {s.kind for s in engine.telemetry.spans()}
        spec = [s.value for s in engine.telemetry.scalars("speculating")]
        notes = [n.text for n in engine.telemetry.notes()]
    assert spec[0] == 1.0 and 0.0 in spec and spec[-1] == 1.0
    assert {"rollback", "replay", "cpu_step"} <= kinds
    assert any("speculation off" in n for n in notes)
    assert any("speculation back on" in n for n in notes)
    assert max_diff(ref, got) < 1e-5


def test_fp16_dynamic_loss_scale_shrinks_on_overflow():
    # 2**24 overflows fp16 gradients at once: the engine skips and halves until it fits.
    config = cfg(initial_scale_power=24, hysteresis=1, max_grad_norm=1.0)
    model = make_model(dtype=torch.float16)
    with so.initialize(model, {"lr": 1e-3}, config) as engine:
        for x, y in batches(STEPS):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        scales = [s.value for s in engine.telemetry.scalars("loss_scale")]
        st = engine.stats
        assert st.skipped_steps >= 1
        assert scales[0] == 2.0**24 and scales[st.skipped_steps] < scales[0]
        assert all(b == a / 2 for a, b in zip(scales[: st.skipped_steps],
                                              scales[1:st.skipped_steps + 1]))
        assert any("overflow" in n.text for n in engine.telemetry.notes())
        for p in model.parameters():
            assert torch.isfinite(p).all()
