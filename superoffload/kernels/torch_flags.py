"""The flags of ``torch.optim.AdamW``, each honoured or refused with the supported way.

A torch-style param group carries, besides ``lr``, ``betas``, ``eps`` and ``weight_decay``,
the switches of ``torch.optim.AdamW`` (``amsgrad``, ``maximize``, ``foreach``, ``fused``,
``capturable``, ``differentiable``, ``decoupled_weight_decay``): a group copied from a torch
optimizer, a Lightning ``configure_optimizers``, a state dict saved by torch. Each is one of

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

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
