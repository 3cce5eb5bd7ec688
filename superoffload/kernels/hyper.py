"""Adam(W) hyper-parameters of one param group: the one type every Adam path takes.

The engine freezes one ``AdamHyper`` per param group when it launches a step (so an LR
scheduler's change applies from the next step and never races with a worker thread); the
CPU kernel, its torch fallback and the device step read the same fields. The per-call
numbers (step count, grad_scale, stochastic-rounding seed) stay call arguments.

Ranges follow ``torch.optim.AdamW`` (PyTorch docs: lr >= 0, 0 <= betas < 1, eps >= 0,
weight_decay >= 0), plus AdamW's ``lr * weight_decay < 1`` (the decoupled decay factor
``1 - lr * wd`` must stay positive, DESIGN.md §4). ``maximize`` is AdamW's: the step uses
-grad (the kernels flip the sign of their gradient scale). torch.optim.AdamW's other flags in
a group are honoured or refused by kernels/torch_flags.py, read by ``from_group``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from superoffload.kernels.torch_flags import adamw_mode_of, check_flags

DEFAULTS: dict[str, Any] = {
    # torch.optim.AdamW's defaults (PyTorch docs), plus the kernel's two switches.
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "adamw_mode": True,
    "bias_correction": True,
    "maximize": False,
}
GROUP_KEYS = frozenset(DEFAULTS)
"""The hyper-parameter keys of a param group (besides ``params``)."""


def _real(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}[{key!r}]={value!r}: use a real number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{where}[{key!r}]={value!r}: use a finite number")
    return out


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """One param group's hyper-parameters, range-checked."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool = True
    bias_correction: bool = True
    maximize: bool = False
    """Step with -grad (torch.optim.AdamW's ``maximize``)."""

    def __post_init__(self) -> None:
        self.check("AdamHyper")

    def check(self, where: str) -> None:
        """Raise TypeError/ValueError naming ``where[key]`` and the fix."""
        for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            _real(where, key, getattr(self, key))
        if self.lr < 0:
            raise ValueError(f"{where}['lr']={self.lr!r}: use a number >= 0")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{where}['betas']: {key}={getattr(self, key)!r}; use two "
                                 "numbers in [0, 1)")
        if self.eps < 0:
            raise ValueError(f"{where}['eps']={self.eps!r}: use a number >= 0")
        if self.weight_decay < 0:
            raise ValueError(f"{where}['weight_decay']={self.weight_decay!r}: use a number >= 0")
        for key in ("adamw_mode", "bias_correction", "maximize"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{where}[{key!r}]={getattr(self, key)!r}: use True or False")
        if self.adamw_mode and self.lr * self.weight_decay >= 1.0:
            raise ValueError(f"{where}: lr * weight_decay = {self.lr * self.weight_decay:g} "
                             "must be < 1 in AdamW mode (the decay factor 1 - lr*wd would not "
                             "be positive); lower lr or weight_decay")

    @classmethod
    def checked(cls, where: str, *, lr: Any, beta1: Any, beta2: Any, eps: Any,
                weight_decay: Any, adamw_mode: Any = True, bias_correction: Any = True,
                maximize: Any = False) -> AdamHyper:
        """From keyword values (the kernels' signature), each real converted to ``float``;
        errors name ``where[key]`` (``where`` = the function called, for example)."""
        hyper = cls.__new__(cls)
        for key, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                           ("weight_decay", weight_decay)):
            object.__setattr__(hyper, key, _real(where, key, value))
        object.__setattr__(hyper, "adamw_mode", adamw_mode)
        object.__setattr__(hyper, "bias_correction", bias_correction)
        object.__setattr__(hyper, "maximize", maximize)
        hyper.check(where)
        return hyper

    @classmethod
    def from_group(cls, group: Mapping[str, Any], where: str = "optimizer") -> AdamHyper:
        """From a torch-style param group (``lr``, ``betas``, ``eps``, ``weight_decay``,
        ``adamw_mode``, ``bias_correction``, ``maximize``; missing keys take ``DEFAULTS``).
        torch.optim.AdamW's flags in it are honoured or refused (kernels/torch_flags.py);
        other keys (a scheduler's ``initial_lr``, a name) are ignored, as torch does."""
        check_flags(group, where)
        g = {**DEFAULTS, **{k: v for k, v in group.items() if k != "params"}}
        betas = g["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"{where}['betas']={betas!r}: use two numbers in [0, 1)")
        hyper = cls.__new__(cls)
        for key, value in (("lr", _real(where, "lr", g["lr"])),
                           ("beta1", _real(where, "betas", betas[0])),
                           ("beta2", _real(where, "betas", betas[1])),
                           ("eps", _real(where, "eps", g["eps"])),
                           ("weight_decay", _real(where, "weight_decay", g["weight_decay"])),
                           ("adamw_mode", adamw_mode_of(group, DEFAULTS["adamw_mode"], where)),
                           ("bias_correction", g["bias_correction"]),
                           ("maximize", g["maximize"])):
            object.__setattr__(hyper, key, value)
        hyper.check(where)
        return hyper
