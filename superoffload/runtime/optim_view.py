"""The param groups of the engine's optimizer (runtime/optimizer.py ``OffloadOptimizer``), as
torch's optimizers take them (docs/conventions.md, "PyTorch's optimizer contract"): the
hyper-parameters given to ``initialize`` normalised into groups, a group added later checked
like one given at the start, and a ``torch.optim`` optimizer's state migrated in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superoffload.kernels.hyper import DEFAULTS, AdamHyper, normalise_group, torch_flag_keys
from superoffload.runtime.engine_state import EngineState


def _check_group(group: Mapping[str, Any], where: str) -> None:
    # ours, and torch.optim.AdamW's flags (each honoured or refused: kernels/hyper.py)
    known = set(DEFAULTS) | torch_flag_keys() | {"params"}
    unknown = sorted(set(group) - known)
    if unknown:
        raise ValueError(
            f"optimizer{where}: unknown key(s) {unknown}; use {sorted(known - {'params'})}"
        )
    # one set of rules (kernels/hyper.py)
    AdamHyper.from_group(group, where=f"optimizer{where}")


def param_groups_from(
    model: torch.nn.Module, optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Normalise ``optimizer`` (a dict of hyperparameters for every trainable parameter, or a
    list of torch-style param-group dicts) into groups of trainable parameters."""
    if optimizer is None:
        optimizer = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer: pass hyperparameters (a dict, or a list of param-group dicts), not a "
            "torch optimizer; the engine owns the optimizer state"
        )
    if isinstance(optimizer, Mapping):
        _check_group(optimizer, "")
        if "params" in optimizer:
            raise ValueError("optimizer['params']: pass a list of groups to choose parameters")
        params = [p for p in model.parameters() if p.requires_grad]
        return [{**DEFAULTS, **normalise_group(dict(optimizer)), "params": params}]
    groups: list[dict[str, Any]] = []
    seen: set[int] = set()
    for k, g in enumerate(optimizer):
        if not isinstance(g, Mapping) or "params" not in g:
            raise TypeError(f"optimizer[{k}]: each group is a dict with a 'params' list")
        _check_group(g, f"[{k}]")
        params = [p for p in _as_list(g["params"]) if p.requires_grad]
        for p in params:
            if id(p) in seen:
                raise ValueError(f"optimizer[{k}]: a parameter appears in more than one group")
            seen.add(id(p))
        groups.append({**DEFAULTS, **normalise_group(dict(g)), "params": params})
    return groups


def defaults_from(optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
                  ) -> dict[str, Any]:
    """The defaults a group added later inherits (torch: the optimizer's constructor keyword
    arguments): the hyper-parameters given as one dict, else AdamW's."""
    if isinstance(optimizer, Mapping):
        return {**DEFAULTS, **normalise_group(
            {k: v for k, v in optimizer.items() if k != "params"})}
    return dict(DEFAULTS)


def new_group(param_group: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``add_param_group``'s argument, checked like a constructor group: known keys, valid
    hyper-parameters once the defaults are filled in; the parameters that require grad."""
    if not isinstance(param_group, Mapping) or "params" not in param_group:
        raise TypeError("add_param_group: pass a dict with a 'params' list, as torch does")
    group = normalise_group(dict(param_group))
    _check_group({**defaults, **group}, ".add_param_group")
    params = [p for p in _as_list(param_group["params"]) if p.requires_grad]
    return {**group, "params": params}


def new_params(group: Mapping[str, Any], state: EngineState) -> list[int]:
    """The indices of a new group's parameters (``add_param_group``): each the engine's
    model's, in no group yet, of the trained dtype; at least one."""
    new = []
    for p in group["params"]:
        i = state.index.get(id(p))
        if i is None:
            raise ValueError("add_param_group: a parameter does not belong to the engine's "
                             "model; an engine trains one model")
        if i in state.group_of:
            raise ValueError(f"add_param_group: parameter {state.names[i]!r} is already in "
                             f"param group {state.group_of[i]}; a parameter has one group")
        if p.dtype != state.model_dtype:
            raise TypeError(f"add_param_group: parameter {state.names[i]!r} is {p.dtype}, the "
                            f"trained ones {state.model_dtype}: cast it first")
        new.append(i)
    if not new:
        raise ValueError("add_param_group: no parameter with requires_grad=True; call "
                         "requires_grad_(True) on them first")
    return new


def _as_list(params: Any) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    return list(params)


# ---------------------------------------------------------------------------- migrating a run
def is_torch_state_dict(state_dict: Any) -> bool:
    """A ``torch.optim`` optimizer's ``state_dict()`` (``state`` keyed by parameter number,
    ``param_groups`` with ``params`` lists), not an engine checkpoint (which has a format)."""
    return (isinstance(state_dict, Mapping) and "format" not in state_dict
            and isinstance(state_dict.get("state"), Mapping)
            and isinstance(state_dict.get("param_groups"), list))


def load_torch_state(engine: Any, state_dict: Mapping[str, Any]) -> None:
    """``engine.optimizer.load_state_dict(adamw.state_dict())``: migrate a run from
    ``torch.optim.AdamW``/``Adam`` (or ``so.CPUAdam``), as torch's own ``load_state_dict``
    does: the engine's param groups must list the same parameters in the same order as the
    torch optimizer's (torch numbers them that way); each group takes the saved
    hyper-parameters (and flags: honoured or refused first, kernels/hyper.py), each
    parameter its ``exp_avg``, ``exp_avg_sq`` and ``step``; the fp32 masters are the weights
    the model holds (load them with ``model.load_state_dict`` before or after: a write is
    adopted). Everything is checked before anything changes. ``engine`` is the engine
    (runtime/engine.py calls this between iterations)."""
    groups, saved = engine.optimizer.param_groups, state_dict["param_groups"]
    mine, theirs = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved]
    if mine != theirs:
        raise ValueError(
            f"load_state_dict: the torch optimizer state has param groups of {theirs} "
            f"parameters, the engine {mine}: build the engine with the same groups in the same "
            "order (so.initialize(model, [{'params': [...], ...}, ...])), as torch's "
            "load_state_dict requires")
    merged = []
    for k, (g, s) in enumerate(zip(groups, saved)):
        hyper = normalise_group({key: v for key, v in s.items()
                                 if key not in ("params", "param_names")})
        # keys torch keeps (a scheduler's initial_lr) come along; flags are checked here
        AdamHyper.from_group({**g, **hyper}, f"load_state_dict: param_groups[{k}]")
        merged.append(hyper)
    st, moments = engine.state, {}
    for g, s in zip(groups, saved):
        for p, pid in zip(g["params"], s["params"]):
            entry = state_dict["state"].get(pid)
            if entry is None:
                # no step taken yet in torch: fresh moments, as torch would
                continue
            i = st.index[id(p)]
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in entry or tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(f"load_state_dict: state of parameter {st.names[i]!r} "
                                     f"has no {key} of shape {tuple(p.shape)}: not an Adam "
                                     "state of this model")
            moments[i] = (entry["exp_avg"], entry["exp_avg_sq"], int(entry.get("step", 0)))
    engine.synchronize()
    with engine.resident_weights():
        engine.writes.adopt_written(where=" before load_state_dict")
        states = engine.export_states()
        for i, s in states.items():
            # a parameter torch never stepped starts from zero moments and step 0, as in torch
            zeros = (torch.zeros_like(s.master), torch.zeros_like(s.master), 0)
            m, v, step = moments.get(i, zeros)
            # the engine keeps fp32 moments on the host, shaped as the master
            shape = s.master.shape
            m32 = m.detach().to("cpu", torch.float32).reshape(shape)
            v32 = v.detach().to("cpu", torch.float32).reshape(shape)
            states[i] = type(s)(s.master, m32, v32, step)
        engine.restore(states)
    for g, hyper in zip(groups, merged):
        g.update(hyper)
