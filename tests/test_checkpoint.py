"""Checkpoints: bit-identical resume, atomic writes, refusal of mismatches, safe loading."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from _tiny_models import make_model

import superoffload as so
from superoffload.runtime.ckpt_files import CheckpointCorrupt
from superoffload.runtime.engine_checkpoint import CheckpointMismatch

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
    with engine, pytest.raises(CheckpointCorrupt, match="not a superoffload checkpoint, or "
                               "tampered; it was not loaded") as info:
        engine.load_checkpoint(str(tmp_path))
    assert "weights_only" not in str(info.value)  # never advice to switch the check off


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


# ---------------------------------------------------------------- disk and folder
def _saved(tmp_path, steps=2):
    """An engine trained `steps` steps, its checkpoint in tmp_path/ckpt; returns it open."""
    model, engine, sched = make()
    train(model, engine, sched, steps)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    return model, engine, sched


def _fill_the_disk(monkeypatch):
    """Every temporary checkpoint file written by ckpt_files goes to /dev/full, where each
    write fails with the kernel's ENOSPC, as on a full disk."""
    import builtins

    from superoffload.runtime import ckpt_files

    real_open = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        if ".tmp-" in os.fspath(file) and "w" in mode:
            return real_open("/dev/full", "wb" if "b" in mode else "w")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(ckpt_files, "open", full_open, raising=False)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_says_no_space_and_the_bytes_needed(tmp_path, monkeypatch):
    """torch.save hides a failed write as "[enforce fail at inline_container.cc:672]
    unexpected pos"; the engine says "no space left on device" and the bytes the file
    needs, and the previous checkpoint stays loadable."""
    import errno

    model, engine, sched = _saved(tmp_path)
    want = engine.master_weights()
    train(model, engine, sched, 1)
    _fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="no space left on device") as info:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert info.value.errno == errno.ENOSPC
    needed = int(str(info.value).split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    size = os.path.getsize(tmp_path / "ckpt" / "engine.pt")
    assert size <= needed < size + (1 << 20)  # the estimate covers the file (~100 kB here)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["engine.pt", "meta.json"]  # no temp
    with so.initialize(make_model(dtype=torch.bfloat16), {"lr": 3e-3, "weight_decay": 0.1},
                       config()) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        got = fresh.master_weights()
    assert all(torch.equal(want[k], got[k]) for k in want)
    engine.close()


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    """When the free space reported is already below the file's size, nothing is written."""
    import shutil
    from collections import namedtuple

    model, engine, sched = _saved(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 4096))
    writes = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (writes.append(1), real_save(*a, **k)))
    with pytest.raises(OSError, match=r"no space left on device: .* needs about [\d,]+ bytes "
                                      r"\(0\.\d MB\), 4,096 bytes free"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert writes == [] and sorted(os.listdir(tmp_path / "ckpt")) == ["engine.pt", "meta.json"]
    engine.close()


def test_two_threads_saving_into_one_folder(tmp_path, monkeypatch):
    """Two threads saving into one folder used to share one temporary name: one failed with
    a raw FileNotFoundError. Now both saves complete, one after the other, and the folder
    holds one whole save (engine.pt and meta.json of the same one: loads without warning)."""
    import contextlib
    import threading
    import warnings

    engines = [make(seed=s)[:2] for s in (0, 1)]
    meet = threading.Barrier(2)
    real_save = torch.save

    def save_together(*args, **kwargs):
        # line the two writes up, as a race would (a saver that waits alone goes on)
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=1.0)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save_together)
    errors = []

    def save(engine):
        try:
            engine.save_checkpoint(str(tmp_path / "shared"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(e,)) for _, e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    assert errors == []
    assert sorted(os.listdir(tmp_path / "shared")) == ["engine.pt", "meta.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a meta.json from the other save would warn
        _, engine = engines[0]
        engine.load_checkpoint(str(tmp_path / "shared"))
    for _, e in engines:
        e.close()


def test_a_sharded_checkpoint_in_a_plain_engine_names_the_way(tmp_path):
    """A data-parallel (DCP) checkpoint loaded into OffloadEngine said `FileNotFoundError: no
    checkpoint at .../engine.pt`; it says the checkpoint is sharded and names
    FsdpOffloadEngine and consolidate(), and consolidate() indeed reads it."""
    from superoffload.distributed import init_distributed, shutdown
    from superoffload.distributed.fsdp import FsdpOffloadEngine, consolidate

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        model = make_model(dtype=torch.bfloat16)
        with FsdpOffloadEngine(model, {"lr": 3e-3}, config()) as zero:
            x = torch.randint(0, 61, (4, 12))
            zero.backward(model(x, torch.roll(x, -1, 1)))
            zero.step()
            zero.save_checkpoint(str(tmp_path / "zero"))
    finally:
        shutdown()
    _, engine, _ = make()
    with engine, pytest.raises(CheckpointMismatch, match="sharded checkpoint") as info:
        engine.load_checkpoint(str(tmp_path / "zero"))
    assert "FsdpOffloadEngine" in str(info.value) and "consolidate(path)" in str(info.value)
    assert set(consolidate(str(tmp_path / "zero")).states) == {
        n for n, p in model.named_parameters() if p.requires_grad}
    # and the reverse: a single-process checkpoint given to the sharded reader
    _, plain, _ = make()
    with plain:
        plain.save_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="single-process checkpoint .*load_checkpoint"):
        consolidate(str(tmp_path / "plain"))
