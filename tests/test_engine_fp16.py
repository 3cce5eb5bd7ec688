"""fp16 training checked by VALUE: the engine against an fp32-master AdamW reference with
PyTorch's own loss scaler, and a save-resume that is bit-identical.

Reference: an fp16 model, fp32 master copies, ``torch.optim.AdamW``,
``torch.amp.GradScaler("cpu")`` and ``clip_grad_norm_`` on the unscaled fp32 gradients.
GradScaler halves the scale on an overflow (and skips the step) and doubles it after
``growth_interval`` clean steps: DeepSpeed's dynamic scaler with ``hysteresis=1``
(runtime/loss_scaler.py), so both sides run the same scale sequence without either one
reading the other's.

The run: scale 2**20 overflows fp16 gradients in the first two steps (skipped, with their
speculative steps rolled back) and again after the scale grows back (window 4); clipping at
1.4 fires in 3 of the 5 stepped iterations (norms 1.61-1.65) and not in the other 2
(1.38, 1.39), so both branches of the verdict run under a loss scale.

Tolerances (8 steps, lr 3e-3, measured on 2 cores):
* loss-scale sequence and skipped steps: identical (powers of two, the same overflow test);
* logged grad norm: rtol 1e-5 (fp64 sum here, fp32 in clip_grad_norm_; measured 1.5e-6).
  A verdict that forgets to unscale is 65536x off;
* fp32 masters: max |diff| 5e-5. Identical until the first clipped step; after it the two
  sides' last-bit differences (coefficient rounding, the order of Adam's ops) flip a few
  fp16 roundings of the forward weights, measured 5.0e-6. The reference without clipping
  is 4.4e-4 away, and the one with one step fewer 3.1e-3;
* device weights: exactly fp16(master) (the kernel's fused round-to-nearest-even copy).
"""

from __future__ import annotations

import math

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff
from _tiny_models import batches, make_model

import superoffload as so

STEPS = 8
MAX_NORM = 1.4
SCALE_POWER = 20
WINDOW = 4

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def fp16_reference(data: list) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """(fp32 masters by name, clip_grad_norm_'s norm per step, scale per step)."""
    model = make_model(dtype=torch.float16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_() for _, p in named]
    opt = torch.optim.AdamW(master, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**SCALE_POWER, growth_interval=WINDOW)
    norms, scales = [], []
    for x, y in data:
        scales.append(scaler.get_scale())
        scaler.scale(model(x, y)).backward()
        for m, (_, p) in zip(master, named):
            m.grad = p.grad.float()
        scaler.unscale_(opt)  # exact: the scale is a power of two
        norms.append(float(torch.nn.utils.clip_grad_norm_(master, MAX_NORM)))
        scaler.step(opt)  # skipped when unscale_ found inf/nan
        scaler.update()
        with torch.no_grad():
            for m, (_, p) in zip(master, named):
                p.copy_(m)
                p.grad = m.grad = None
    return {n: m.detach() for (n, _), m in zip(named, master)}, norms, scales


def fp16_config(**kw: object) -> so.OffloadConfig:
    return cpu_config(**{"ratio": 0.5, "max_grad_norm": MAX_NORM, "hysteresis": 1,
                         "initial_scale_power": SCALE_POWER, "loss_scale_window": WINDOW, **kw})


@pytest.mark.parametrize("rollback", ["inverse", "snapshot"])
def test_fp16_run_matches_fp32_master_adamw_with_grad_scaler(rollback: str) -> None:
    data = batches(STEPS)
    want, want_norms, want_scales = fp16_reference(data)
    model = make_model(dtype=torch.float16)
    with so.initialize(model, dict(HYPER), fp16_config(rollback=rollback)) as engine:
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        norms = [s.value for s in engine.telemetry.scalars("grad_norm")]
        scales = [s.value for s in engine.telemetry.scalars("loss_scale")]
        stats = engine.stats
        device = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the run exercises what it claims: skips (rolled back), clipped and unclipped steps
    finite = [n for n in want_norms if math.isfinite(n)]
    assert 0 < stats.skipped_steps == STEPS - len(finite)
    assert stats.rollbacks > 0
    assert 0 < stats.clipped_steps == sum(n > MAX_NORM for n in finite) < len(finite)
    assert scales == want_scales
    first = next(k for k, n in enumerate(want_norms) if math.isfinite(n))
    for step, (a, b) in enumerate(zip(norms, want_norms)):
        if math.isfinite(b):  # the same weights up to the first stepped iteration
            assert a == pytest.approx(b, rel=1e-6 if step == first else 1e-4), (step, norms,
                                                                                  want_norms)
        else:
            assert math.isinf(a), (step, norms, want_norms)
    assert max_diff(want, got) < 5e-5
    for name, w in got.items():
        assert torch.equal(device[name], w.half()), name


def _train(model: torch.nn.Module, engine: so.OffloadEngine, data: list) -> None:
    for x, y in data:
        engine.backward(model(x, y))
        engine.step()
        engine.zero_grad()


def test_fp16_resume_is_bit_identical(tmp_path) -> None:
    """Save mid-run after the scale has come down from 2**20, load into a fresh engine (other
    initial weights, a fresh scaler at 2**20), continue: every bit as the straight run. A
    scaler not restored overflows again after the load and skips steps the run did not."""
    steps, stop = 10, 4
    data = batches(steps)
    config = fp16_config(hysteresis=2)  # DeepSpeed's default: its counter is state too

    model = make_model(dtype=torch.float16)
    with so.initialize(model, dict(HYPER), config) as engine:
        _train(model, engine, data)
        want = engine.master_weights()
        want_scales = [s.value for s in engine.telemetry.scalars("loss_scale")]
        want_skipped = engine.stats.skipped_steps
        want_device = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = make_model(dtype=torch.float16)
    with so.initialize(model, dict(HYPER), config) as engine:
        _train(model, engine, data[:stop])
        saved_scale = engine.scaler.loss_scale
        engine.save_checkpoint(str(tmp_path))
    assert saved_scale < 2.0**SCALE_POWER  # the saved scaler state differs from a fresh one

    model = make_model(seed=7, dtype=torch.float16)
    with so.initialize(model, dict(HYPER), config) as engine:
        engine.load_checkpoint(str(tmp_path))
        assert engine.iteration == stop
        _train(model, engine, data[stop:])
        got = engine.master_weights()
        scales = [s.value for s in engine.telemetry.scalars("loss_scale")]
        skipped = engine.stats.skipped_steps
        device = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert scales == want_scales[stop:]
    assert skipped == want_skipped
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for name in want_device:
        assert torch.equal(device[name], want_device[name]), name
