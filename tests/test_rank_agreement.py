"""What data-parallel ranks must agree on is derived from the data, not from a list: the
construction fingerprint covers every OffloadConfig field but the declared rank-local ones and
every field of every param group's AdamHyper; the per-step hash (carried by the validation
all-reduce) covers every field of AdamHyper. Each test changes ONE key at a time and fails if
it is not seen, so dropping a key from either is caught (the 2-rank runs:
tests/test_contract_dp.py, weight_decay 0.1 against 0.2 included)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from superoffload.config import OffloadConfig
from superoffload.kernels.hyper import DEFAULTS, FLAGS, AdamHyper
from superoffload.runtime import contract
from superoffload.runtime.engine_state import EngineState

BASE = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _other(value):
    """A different valid value of the same kind (derived, not listed per key)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return value * 0.5 if value else 0.05
    if isinstance(value, tuple):
        return tuple(_other(v) for v in value)
    raise AssertionError(f"no other value for {value!r}: teach _other its type")


def _group_variants():
    """Every key of a param group the optimizer reads (ours, and the torch flags it honours),
    each changed alone; betas one element at a time."""
    base = {**DEFAULTS, **BASE}
    keys = sorted(set(DEFAULTS) | {k for k, f in FLAGS.items() if f.handling == "honoured"})
    for key in keys:
        value = base.get(key, DEFAULTS.get("adamw_mode") if key == "decoupled_weight_decay"
                         else None)
        if key == "betas":
            for i in range(2):
                b = list(value)
                b[i] = _other(b[i])
                yield f"betas[{i}]", {**base, "betas": tuple(b)}
        elif key == "decoupled_weight_decay":  # torch's name of adamw_mode
            yield key, {**{k: v for k, v in base.items() if k != "adamw_mode"}, key: not value}
        else:
            yield key, {**base, key: _other(value)}


VARIANTS = list(_group_variants())


def test_every_group_key_is_a_field_of_adam_hyper():
    base = AdamHyper.from_group({**DEFAULTS, **BASE})
    for key, group in VARIANTS:
        assert AdamHyper.from_group(group) != base, key


@pytest.mark.parametrize(("key", "group"), VARIANTS, ids=[k for k, _ in VARIANTS])
def test_per_step_hash_sees_every_key(key, group):
    base = AdamHyper.from_group({**DEFAULTS, **BASE})
    other = AdamHyper.from_group(group)
    for clip in (None, 1.0):
        assert contract.hyper_hash([base], clip) != contract.hyper_hash([other], clip), key
    assert contract.hyper_hash([base], None) != contract.hyper_hash([base], 1.0)


def _state() -> EngineState:
    model = torch.nn.Linear(3, 2)
    return EngineState.from_model(model, [{"params": list(model.parameters()), **DEFAULTS}])


@pytest.mark.parametrize(("key", "group"), VARIANTS, ids=[k for k, _ in VARIANTS])
def test_fingerprint_sees_every_key_and_names_it(key, group):
    st, config = _state(), OffloadConfig()
    base = contract.fingerprint(st, config, [AdamHyper.from_group({**DEFAULTS, **BASE})])
    other = contract.fingerprint(st, config, [AdamHyper.from_group(group)])
    diff = contract.first_difference([base, other], [0, 1])
    assert diff is not None and diff.startswith("param_groups"), key
    field = {"betas[0]": "beta1", "betas[1]": "beta2",
             "decoupled_weight_decay": "adamw_mode"}.get(key, key)
    assert f"'{field}'" in diff  # the message names the hyper-parameter


def test_fingerprint_sees_every_config_field_but_the_rank_local_ones():
    st, config = _state(), OffloadConfig()
    names = {f.name for f in dataclasses.fields(OffloadConfig)}
    assert names >= contract._RANK_LOCAL  # a renamed field is not silently compared
    base = contract.fingerprint(st, config, [])
    for name in sorted(names - contract._RANK_LOCAL):
        changed = copy.copy(config)
        object.__setattr__(changed, name, object())  # any other value
        diff = contract.first_difference([base, contract.fingerprint(st, changed, [])], [0, 1])
        assert diff is not None and diff.startswith(f"config.{name} "), name


def test_fingerprint_sees_which_group_each_parameter_is_in():
    """Two ranks with the same parameters and the same two groups' hyper-parameters, the
    bias in group 1 on one and in group 0 on the other: the ranks would step it with
    different settings (the per-step hash of the groups agrees), so the fingerprint must
    differ, naming that parameter."""
    model = torch.nn.Linear(3, 2)
    hyper = [{**DEFAULTS, **BASE}, {**DEFAULTS, **BASE, "weight_decay": 0.0}]
    split = EngineState.from_model(model, [{"params": [model.weight], **hyper[0]},
                                           {"params": [model.bias], **hyper[1]}])
    joined = EngineState.from_model(model, [{"params": [model.weight, model.bias], **hyper[0]},
                                            {"params": [], **hyper[1]}])
    hypers = [AdamHyper.from_group(g) for g in hyper]
    prints = [contract.fingerprint(st, OffloadConfig(), hypers) for st in (split, joined)]
    diff = contract.first_difference(prints, [0, 1])
    assert diff is not None and diff.startswith("parameter #1 differs"), diff
    assert "'bias'" in diff
