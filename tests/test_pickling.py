"""Pickling a model with an engine attached, and the engine itself (docs/failure_semantics.md,
"The engine").

`torch.save(model)` / `pickle.dumps(model)` failed while an engine was attached (`Can't pickle
local object '_timeline_hooks.<locals>.forward_end'`: the hooks were closures), and pickling
the engine failed with `cannot pickle '_thread.lock'`. Wanted: the model pickles (with its
latest weights; the copy's hooks do nothing, as with `copy.deepcopy`), and the engine refuses
with a TypeError that points to `save_checkpoint`.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from _engine_ref import cpu_config
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def _trained(steps: int = 3) -> tuple[torch.nn.Module, so.OffloadEngine]:
    model = make_model(0)
    engine = so.initialize(model, {"lr": 1e-2}, cpu_config(ratio=0.5))
    for x, y in batches(steps):
        engine.backward(model(x, y))
        engine.step()
        engine.zero_grad()
    engine.synchronize()  # every bucket's weights are published into the model
    return model, engine


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_model_with_an_engine_attached_pickles(how: str) -> None:
    model, engine = _trained()
    want = _weights(model)
    if how == "pickle":
        copy_ = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copy_ = torch.load(buf, weights_only=False)
    got = _weights(copy_)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # the latest weights, bit for bit
    # the copy trains on its own: its hooks do not call into the engine
    iteration, stats = engine.iteration, engine.stats.as_dict()
    x, y = batches(1, seed=5)[0]
    copy_(x, y).backward()
    assert engine.iteration == iteration and engine.stats.as_dict() == stats
    assert all(torch.equal(v, want[k]) for k, v in _weights(model).items())
    # and the original keeps training with its engine
    engine.backward(model(x, y))
    engine.step()
    engine.synchronize()
    assert engine.iteration == iteration + 1
    assert any(not torch.equal(v, want[k]) for k, v in _weights(model).items())
    engine.close()


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_pickling_the_engine_is_a_type_error_naming_save_checkpoint(how: str) -> None:
    model, engine = _trained(1)
    with engine, pytest.raises(TypeError, match="save_checkpoint") as info:
        if how == "pickle":
            pickle.dumps(engine)
        elif how == "torch.save":
            torch.save(engine, io.BytesIO())
        else:
            copy.deepcopy(engine)
    assert "_thread.lock" not in str(info.value)
