"""Dynamic loss scaling for fp16, with DeepSpeed's semantics (its dynamic loss
scaler): halve on overflow once ``hysteresis``
overflows have been tolerated, never below ``min_scale``; double after ``scale_window``
overflow-free iterations. bf16 and fp32 use a static scale (1.0 unless configured).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from superoffload.config import OffloadConfig


class LossScaler:
    """Static (``dynamic=False``) or dynamic loss scale."""

    def __init__(
        self,
        *,
        dynamic: bool,
        init_scale: float = 1.0,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
    ) -> None:
        self.dynamic = dynamic
        self.cur_scale = float(init_scale)
        self.scale_window = scale_window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = scale_factor
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def for_model(cls, config: OffloadConfig, model_dtype: torch.dtype) -> LossScaler:
        """The scaler an engine uses for a model of `model_dtype`: dynamic only for fp16 with
        `loss_scale="dynamic"`; a static fp16 scale from `static_loss_scale`; 1.0 otherwise."""
        fp16 = model_dtype == torch.float16
        dynamic = fp16 and config.loss_scale == "dynamic"
        # bf16 and fp32 share fp32's exponent range: no scale needed
        init = 1.0
        if dynamic:
            # DeepSpeed's initial_scale_power: start high, halve on overflow
            init = 2.0**config.initial_scale_power
        elif fp16:
            init = config.static_loss_scale
        return cls(dynamic=dynamic, init_scale=init, scale_window=config.loss_scale_window,
                   hysteresis=config.hysteresis, min_scale=config.min_loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        """Call once per iteration with that iteration's overflow verdict. Returns whether the
        scale accounts for the skip: an overflow while a dynamic scale can still come down
        (runtime/skips.py counts the skips it does not account for)."""
        explained = overflow and self.dynamic and self.cur_scale > self.min_scale
        if not self.dynamic:
            return explained
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return explained

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
