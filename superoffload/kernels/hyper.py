"""Adam(W) hyper-parameters of one param group: the one type every Adam path takes.

The engine freezes one ``AdamHyper`` per param group when it launches a step (so an LR
scheduler's change applies from the next step and never races with a worker thread); the
CPU kernel, its torch fallback and the device step read the same fields. The per-call
numbers (step count, grad_scale, stochastic-rounding seed) stay call arguments.

Ranges follow ``torch.optim.AdamW`` (PyTorch docs: lr >= 0, 0 <= betas < 1, eps >= 0,
weight_decay >= 0), plus AdamW's ``lr * weight_decay < 1`` (the decoupled decay factor
``1 - lr * wd`` must stay positive, DESIGN.md §4). ``maximize`` is AdamW's: the step uses
-grad (the kernels flip the sign of their gradient scale).

torch.optim.AdamW's flags, each honoured or refused with the supported way (``check_flags``,
read by ``from_group``): a torch-style param group carries, besides ``lr``, ``betas``, ``eps``
and ``weight_decay``, the switches of ``torch.optim.AdamW`` (``amsgrad``, ``maximize``,
``foreach``, ``fused``, ``capturable``, ``differentiable``, ``decoupled_weight_decay``): a group
copied from a torch optimizer, a Lightning ``configure_optimizers``, a state dict saved by
torch. Each is one of

* honoured: ``maximize`` (a step with -grad, as AdamW's ``maximize=True``; the kernels flip
  the sign of their gradient scale, which is exact) and ``decoupled_weight_decay`` (it is our
  ``adamw_mode``: AdamW's decoupled decay when True, Adam's L2 when False);
* accepted: ``foreach`` and ``fused`` pick how torch runs the same maths; superoffload runs its
  own kernels whatever they say (docs/kernel.md, "torch.optim flags");
* refused unless at torch's default: ``amsgrad`` (its running maximum of v is not invertible,
  so a speculative step could not be rolled back, and it needs a third moment buffer),
  ``capturable`` (CUDA-graph capture of the optimizer step; the engine's step is host code)
  and ``differentiable`` (autograd through the step). Each message names the supported way.

The list of flags is not kept by hand: it is read from ``torch.optim.AdamW``'s own
``defaults`` (and ``torch.optim.Adam``'s), so a flag a newer torch adds is refused when set
away from its default (``check_flags``) and fails ``tests/test_torch_flags.py`` until it is
given a row in ``FLAGS``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


# ---------------------------------------------------------------------------- torch's flags
HYPER_KEYS = frozenset({"lr", "betas", "eps", "weight_decay"})
"""The keys torch's Adam(W) groups share with ours (kernels/hyper.py ``DEFAULTS``)."""


@dataclass(frozen=True, slots=True)
class Flag:
    """What superoffload does with one torch.optim.AdamW flag."""

    handling: str
    """"honoured", "accepted" (an implementation choice) or "refused"."""
    note: str
    """What it does here; for a refused flag, why and the supported way."""
    allowed: tuple[Any, ...] = ()
    """Refused flags: the values accepted (torch's default)."""


FLAGS: dict[str, Flag] = {
    "maximize": Flag("honoured", "steps with -grad (AdamW's maximize=True)"),
    "decoupled_weight_decay": Flag(
        "honoured", "is adamw_mode: True = AdamW's decoupled decay, False = Adam's L2"),
    "foreach": Flag("accepted", "how torch runs its loop; superoffload's kernels run either way"),
    "fused": Flag("accepted", "how torch runs its loop; superoffload's kernels run either way"),
    "amsgrad": Flag(
        "refused",
        "amsgrad=True is not supported: its running maximum of exp_avg_sq cannot be undone, "
        "so a speculative step could not be rolled back. Train with amsgrad=False (the "
        "default), or keep this model on torch.optim.AdamW(amsgrad=True) without offloading",
        (False,)),
    "capturable": Flag(
        "refused",
        "capturable=True (CUDA-graph capture of the optimizer step) is not supported: the "
        "offloaded step runs on the CPU, outside any graph. Leave capturable=False",
        (False,)),
    "differentiable": Flag(
        "refused",
        "differentiable=True (autograd through the optimizer step) is not supported: the "
        "kernels update the state in place without a graph. Leave differentiable=False, or "
        "use torch.optim.AdamW(differentiable=True) without offloading",
        (False,)),
}


@functools.cache
def torch_group_defaults() -> dict[str, Any]:
    """Every key of ``torch.optim.AdamW``'s and ``Adam``'s param groups with AdamW's default
    (read from the classes' own ``defaults``, so a flag added by a newer torch is here)."""
    p = torch.zeros(1, requires_grad=True)
    adam = dict(torch.optim.Adam([p]).defaults)
    return {**adam, **torch.optim.AdamW([p]).defaults}


def torch_flag_keys() -> frozenset[str]:
    """The flags of torch's Adam(W) groups: every key but params and the shared hyper keys."""
    return frozenset(torch_group_defaults()) - HYPER_KEYS


def torch_flags(group: Mapping[str, Any]) -> dict[str, Any]:
    """The torch.optim flags ``group`` holds (a torch optimizer's group, say), to carry
    into an engine or ``CPUAdam`` group, which honours or refuses each."""
    keys = torch_flag_keys()
    return {k: v for k, v in group.items() if k in keys}


def check_flags(group: Mapping[str, Any], where: str) -> None:
    """Raise ValueError/TypeError naming ``where[key]`` and the supported way for a flag
    that cannot be honoured; other keys (ours, or ones torch ignores too) pass."""
    for key, value in group.items():
        flag = FLAGS.get(key)
        if flag is None:
            defaults = torch_group_defaults()
            if key in defaults and key not in HYPER_KEYS and value != defaults[key]:
                raise ValueError(
                    f"{where}[{key!r}]={value!r}: torch.optim.AdamW flag {key!r} is not one "
                    f"superoffload knows (docs/kernel.md, \"torch.optim flags\"); leave it at "
                    f"its default {defaults[key]!r}")
            continue
        if flag.handling == "refused" and not (isinstance(value, bool)
                                               and value in flag.allowed):
            raise ValueError(f"{where}[{key!r}]={value!r}: {flag.note}")
        if flag.handling == "honoured" and not isinstance(value, bool):
            raise TypeError(f"{where}[{key!r}]={value!r}: use True or False")
        if flag.handling == "accepted" and not (value is None or isinstance(value, bool)):
            raise TypeError(f"{where}[{key!r}]={value!r}: use True, False or None")


def normalise_group(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` (in place) with ``adamw_mode`` taken from torch's ``decoupled_weight_decay``
    when only that one is given (a group of torch.optim.Adam/AdamW): one switch, two names."""
    if "decoupled_weight_decay" in group and "adamw_mode" not in group:
        group["adamw_mode"] = group["decoupled_weight_decay"]
    return group


def adamw_mode_of(group: Mapping[str, Any], default: Any, where: str) -> Any:
    """The group's ``adamw_mode``, agreeing with ``decoupled_weight_decay`` when both are set
    (a contradiction raises: they are the same switch)."""
    mode = group.get("adamw_mode", default)
    if "decoupled_weight_decay" in group:
        dwd = group["decoupled_weight_decay"]
        if "adamw_mode" in group and dwd != mode:
            raise ValueError(
                f"{where}: decoupled_weight_decay={dwd!r} contradicts adamw_mode={mode!r} (one "
                "switch, torch's name and ours): set both to the same value, or drop one")
        mode = dwd
    return mode


# ---------------------------------------------------------------------------- the hyper-parameters
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

    def bias_corrections(self, step: int) -> tuple[float, float]:
        """``(1 - beta1**step, 1 - beta2**step)`` in double (DESIGN.md §4's bc_1, bc_2);
        ``(1.0, 1.0)`` when ``bias_correction`` is off."""
        if not self.bias_correction:
            return 1.0, 1.0
        return 1.0 - self.beta1**step, 1.0 - self.beta2**step

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
        torch.optim.AdamW's flags in it are honoured or refused (``check_flags``);
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


def hypers_of(groups: Sequence[Mapping[str, Any]]) -> list[AdamHyper]:
    """One frozen AdamHyper per param group of an offload engine, read now (an LR
    scheduler's change applies from the step that reads it). The engine needs ``eps > 0``
    where torch takes ``eps >= 0`` (runtime/skips.py says why; ``CPUAdam`` and the kernels
    follow torch)."""
    hypers = [AdamHyper.from_group(g, where=f"optimizer.param_groups[{k}]")
              for k, g in enumerate(groups)]
    for k, h in enumerate(hypers):
        if h.eps <= 0.0:
            raise ValueError(
                f"optimizer.param_groups[{k}]['eps']={h.eps!r}: the engine needs eps > 0. "
                "With eps=0 Adam divides 0 by 0 for every element whose gradient has been 0 "
                "so far (torch writes NaN into those weights); the engine never writes a "
                "non-finite state, so it would skip every such step. Use a small positive eps "
                "(torch's default is 1e-8)")
    return hypers
