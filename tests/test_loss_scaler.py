"""The loss scaler (runtime/loss_scaler.py), by hand: DeepSpeed's dynamic scaling from the
first iteration on, hysteresis, a state dict taken mid-hysteresis, the scaler an engine's
settings give, and which skips the scale accounts for (runtime/skips.py counts the others).
tests/test_stv.py checks a sequence that starts with overflows; these start clean."""

from __future__ import annotations

import pytest
import torch

from superoffload.config import OffloadConfig
from superoffload.runtime.loss_scaler import LossScaler


def trajectory(s: LossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        s.update(overflow)
        out.append(s.loss_scale)
    return out


def test_a_clean_run_grows_every_window_from_the_first_iteration() -> None:
    """As torch's GradScaler(growth_interval=3): doubled after every 3 clean iterations."""
    s = LossScaler(dynamic=True, init_scale=4.0, scale_window=3, hysteresis=2, min_scale=1.0)
    assert trajectory(s, [False] * 7) == [4, 4, 8, 8, 8, 16, 16]


def test_hysteresis_tolerates_that_many_overflows_minus_one() -> None:
    s = LossScaler(dynamic=True, init_scale=64.0, scale_window=100, hysteresis=3, min_scale=1.0)
    assert trajectory(s, [True, True, True, True]) == [64, 64, 32, 16]
    # a window of clean iterations after the last overflow restores it
    s = LossScaler(dynamic=True, init_scale=64.0, scale_window=2, hysteresis=3, min_scale=1.0)
    assert trajectory(s, [True, False, False, True, True, True]) == [64, 64, 128, 128, 128, 64]


def test_a_state_dict_taken_mid_hysteresis_continues_alike() -> None:
    run = [True, False, True, True, False, False, False]
    a = LossScaler(dynamic=True, init_scale=64.0, scale_window=3, hysteresis=3, min_scale=1.0)
    a.update(True)  # one overflow tolerated: hysteresis 2 left
    b = LossScaler(dynamic=True, init_scale=1.0, scale_window=3, hysteresis=3, min_scale=1.0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert trajectory(b, run) == trajectory(a, run)


def test_the_engines_scaler_comes_from_its_settings() -> None:
    cfg = OffloadConfig(initial_scale_power=5, loss_scale_window=7, hysteresis=3,
                        min_loss_scale=2.0, static_loss_scale=128.0)
    fp16 = LossScaler.for_model(cfg, torch.float16)
    assert (fp16.dynamic, fp16.loss_scale, fp16.scale_window, fp16.delayed_shift,
            fp16.min_scale) == (True, 32.0, 7, 3, 2.0)
    static = LossScaler.for_model(cfg.replace(loss_scale="none"), torch.float16)
    assert (static.dynamic, static.loss_scale) == (False, 128.0)
    for dtype in (torch.bfloat16, torch.float32):  # no scaling whatever fp16 would use
        other = LossScaler.for_model(cfg, dtype)
        assert (other.dynamic, other.loss_scale) == (False, 1.0)
    # the constructor's defaults are the settings' (DeepSpeed's): 2**16, 1000, 2, 1
    default = LossScaler.for_model(OffloadConfig(), torch.float16)
    plain = LossScaler(dynamic=True, init_scale=2.0 ** 16)
    assert vars(plain) == vars(default)
    assert LossScaler(dynamic=False).loss_scale == 1.0


@pytest.mark.parametrize("dynamic, scale, overflow, explained", [
    (True, 4.0, True, True),    # the scale can come down: its own search
    (True, 1.0, True, False),   # at its minimum: not the scale
    (True, 4.0, False, False),  # nothing skipped
    (False, 4.0, True, False),  # a static scale never accounts for a skip
])
def test_update_says_whether_the_scale_accounts_for_a_skip(dynamic: bool, scale: float,
                                                           overflow: bool,
                                                           explained: bool) -> None:
    s = LossScaler(dynamic=dynamic, init_scale=scale, scale_window=10, hysteresis=1,
                   min_scale=1.0)
    assert s.update(overflow) is explained
