"""The checkpoint seal (runtime/ckpt_files.py ``seal`` / ``check_seal``) covers every part of
the payload: each tensor's bytes, each value, and each key of every mapping. A key changed on
disk (a flipped byte in a parameter's name, a state entry read back under another name) is a
different checkpoint: loading it must be refused as corrupt, as a changed value is.
The keys tried are every string key of a real engine state dict, found by walking it."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime.ckpt_files import SEAL_KEY, CheckpointCorrupt, check_seal, seal


def _payload() -> dict[str, Any]:
    model = make_model()
    with so.initialize(model, dict(HYPER), cpu_config(ratio=0.5)) as engine:
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        engine.step()
        return engine.state_dict()  # type: ignore[no-any-return]


def _keys(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every string key of every mapping inside ``value``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str):
                yield (*path, k)
            yield from _keys(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _keys(v, (*path, i))


def _renamed(payload: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    """A copy of ``payload`` with the key at ``path`` renamed, its value and place kept (its
    last letter changed to the next one: the sorted order of the keys is the same)."""
    out = copy.deepcopy(payload)
    holder: Any = out
    for step in path[:-1]:
        holder = holder[step]
    key = path[-1]
    new = key[:-1] + chr(ord(key[-1]) + 1) if key else "_"
    assert new not in holder
    items = list(holder.items())
    holder.clear()
    holder.update((new if k == key else k, v) for k, v in items)
    return out


@pytest.fixture(scope="module")
def sealed() -> dict[str, Any]:
    return seal(_payload())


def test_the_seal_passes_an_unchanged_payload_and_refuses_a_changed_value(sealed):
    check_seal(copy.deepcopy(sealed), "engine.pt")
    changed = copy.deepcopy(sealed)
    changed["iteration"] = changed["iteration"] + 1
    with pytest.raises(CheckpointCorrupt, match="engine.pt is corrupt"):
        check_seal(changed, "engine.pt")


def test_the_seal_refuses_any_renamed_key(sealed):
    paths = [p for p in _keys(sealed) if p != (SEAL_KEY,)]
    assert len(paths) > 20  # every part of a real state dict: groups, states, stats, scaler
    missed = []
    for path in paths:
        try:
            check_seal(_renamed(sealed, path), "engine.pt")
            missed.append(path)
        except CheckpointCorrupt:
            pass
    assert not missed, f"keys the seal does not cover: {missed[:5]}"


def test_keys_and_values_are_not_confused():
    """{"a": "b"} and {"b": "a"} are different payloads (tags keep keys and values apart)."""
    assert seal({"a": "b"})[SEAL_KEY] != seal({"b": "a"})[SEAL_KEY]
    assert seal({"x": torch.zeros(2)})[SEAL_KEY] != seal({"y": torch.zeros(2)})[SEAL_KEY]
