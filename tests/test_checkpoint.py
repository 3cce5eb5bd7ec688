"""Checkpoints: bit-identical resume, atomic writes, refusal of mismatches, safe loading."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from _tiny_models import make_model

import superoffload as so
from superoffload.runtime.checkpoint import CheckpointMismatch

STEPS, STOP = 10, 4


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def config(**kw):
    base = {"device": "cpu", "bucket_bytes": 4096, "ratio": 0.5, "cpu_threads": 1,
            "max_grad_norm": 0.3, "speculation": "adaptive", "adaptive_window": 3}
    return so.OffloadConfig(**{**base, **kw})


def make(seed=0, dtype=torch.bfloat16, **kw):
    model = make_model(seed=seed, dtype=dtype)
    engine = so.initialize(model, {"lr": 3e-3, "weight_decay": 0.1}, config(**kw))
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=3, gamma=0.5)
    return model, engine, sched


def train(model, engine, sched, steps):
    for _ in range(steps):
        # the batch comes from the global RNG, so a resume must restore it to match
        x = torch.randint(0, 61, (4, 12))
        engine.backward(model(x, torch.roll(x, -1, 1)))
        engine.step()
        engine.zero_grad()
        sched.step()


def snapshot(model, engine):
    weights = {k: v.clone() for k, v in engine.master_weights().items()}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return weights, params


def test_resume_is_bit_identical(tmp_path):
    torch.manual_seed(123)
    model, engine, sched = make()
    train(model, engine, sched, STEPS)
    want_w, want_p = snapshot(model, engine)
    want_lr, want_stats = sched.get_last_lr(), engine.stats
    engine.close()

    torch.manual_seed(123)
    model, engine, sched = make()
    train(model, engine, sched, STOP)
    engine.save_checkpoint(str(tmp_path), extra={"note": "k", "step": STOP}, lr_scheduler=sched)
    engine.close()
    torch.manual_seed(999)  # scramble the RNG: the checkpoint must restore it

    model, engine, sched = make(seed=7, ratio=1.0)  # other init; other placement is allowed
    extra = engine.load_checkpoint(str(tmp_path), lr_scheduler=sched)
    assert extra == {"note": "k", "step": STOP}
    assert engine.iteration == STOP
    engine.reconfigure(ratio=0.5)
    train(model, engine, sched, STEPS - STOP)
    got_w, got_p = snapshot(model, engine)
    for k in want_w:
        assert torch.equal(got_w[k], want_w[k]), k
    for k in want_p:
        assert torch.equal(got_p[k], want_p[k]), k
    assert sched.get_last_lr() == want_lr
    assert engine.stats.clipped_steps == want_stats.clipped_steps
    assert engine.stats.speculation_enabled == want_stats.speculation_enabled
    engine.close()


def test_killed_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, engine, sched = make()
    train(model, engine, sched, 2)
    engine.save_checkpoint(str(tmp_path))
    train(model, engine, sched, 2)

    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        f.write(b"partial garbage")  # the process "dies" halfway through the write
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(tmp_path))
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(os.listdir(tmp_path)) == ["engine.pt", "meta.json"]  # no temp left behind
    engine.load_checkpoint(str(tmp_path))
    assert engine.iteration == 2
    engine.close()


def test_mismatched_model_or_config_refused(tmp_path):
    model, engine, sched = make()
    train(model, engine, sched, 1)
    engine.save_checkpoint(str(tmp_path))
    engine.close()

    other = make_model(dtype=torch.bfloat16, n_blocks=2)
    with so.initialize(other, {"lr": 3e-3}, config()) as e2, pytest.raises(
        CheckpointMismatch, match="blocks.2"
    ):
        e2.load_checkpoint(str(tmp_path))
    with so.initialize(make_model(dtype=torch.float32), {}, config()) as e3, pytest.raises(
        CheckpointMismatch, match="dtype"
    ):
        e3.load_checkpoint(str(tmp_path))
    model, e4, _ = make(max_grad_norm=5.0)
    with e4, pytest.raises(CheckpointMismatch, match="max_grad_norm"):
        e4.load_checkpoint(str(tmp_path))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_loading_never_unpickles_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(tmp_path / "engine.pt", "wb") as f:
        pickle.dump({"format": Evil()}, f)
    model, engine, _ = make()
    with engine, pytest.raises(pickle.UnpicklingError):
        engine.load_checkpoint(str(tmp_path))


def test_state_dict_roundtrip_in_memory():
    model, engine, sched = make()
    train(model, engine, sched, 3)
    sd = engine.optimizer.state_dict()  # the torch contract delegates to the engine
    before = engine.master_weights()
    train(model, engine, sched, 2)
    engine.load_state_dict(sd)
    assert engine.iteration == 3
    after = engine.master_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
