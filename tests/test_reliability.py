"""Faults and misuse that used to train wrong or hang (docs/failure_semantics.md, "The engine").

Each test fails on the engine before this change: an interrupted backward mixed two batches,
``zero_grad()`` before ``step()`` raised AttributeError and trained wrong, a second backward
was half-accumulated, a dropped or failed engine kept its threads and hooks (and poisoned
the model), checkpoints loaded flipped bytes silently, a failed step left an empty checkpoint
folder, bad settings failed only at the first step in a worker thread.
"""

from __future__ import annotations

import copy
import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt_support import flip_tensor_byte
from _engine_ref import HYPER
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import ConfigError, OffloadConfig
from superoffload.runtime import steps, stv
from superoffload.runtime.ckpt_files import CheckpointCorrupt
from superoffload.runtime.errors import EngineError, IterationInterrupted

DATA = batches(8, seed=2, batch=4, seq=12)


def cfg(**kw: Any) -> OffloadConfig:
    base = {"device": "cpu", "bucket_bytes": 4096, "ratio": 0.5, "cpu_threads": 1,
            "speculation": "on", "telemetry": True, "max_grad_norm": None}
    return OffloadConfig(**{**base, **kw})


def run(config: OffloadConfig, plan: list[str]) -> dict[str, torch.Tensor]:
    """Train on DATA following ``plan`` (one entry per batch: "step", "skip"); returns masters."""
    model = make_model(0)
    with so.initialize(model, HYPER, config) as engine:
        for (x, y), what in zip(DATA, plan):
            if what == "step":
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
        return engine.master_weights()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


class Interrupt:
    """A post-accumulate-grad hook on an early parameter that raises once, mid-backward:
    by then the later layers' buckets were launched and speculatively stepped."""

    def __init__(self, model: torch.nn.Module, exc: BaseException) -> None:
        self.armed, self.exc = False, exc
        early = next(p for n, p in model.named_parameters() if "blocks.0." in n)
        early.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        if self.armed:
            self.armed = False
            raise self.exc


@pytest.mark.parametrize("rollback", ["snapshot", "inverse"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), torch.OutOfMemoryError("simulated")])
def test_an_interrupted_backward_is_rolled_back(rollback: str, exc: BaseException) -> None:
    config = cfg(rollback=rollback)
    want = run(config, ["step"] * 5)
    model = make_model(0)
    hook = Interrupt(model, exc)
    with so.initialize(model, HYPER, config) as engine:
        for k, (x, y) in enumerate(DATA[:5]):
            if k == 2:  # interrupted, then the user runs the same batch again
                hook.armed = True
                with pytest.raises(type(exc)):
                    engine.backward(model(x, y))
                assert engine.stats.rollbacks > 0  # speculative steps had run: undone
                assert engine.launcher.current.micro_step == 0
                engine.zero_grad()
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        assert any("interrupted" in n.text for n in engine.telemetry.notes())
    assert_same(want, got, exact=rollback == "snapshot")


def test_zero_grad_between_backward_and_step_discards_the_iteration() -> None:
    config = cfg(rollback="snapshot")
    want = run(config, ["step", "skip", "step", "step"])  # batch 1 never trained
    model = make_model(0)
    with so.initialize(model, HYPER, config) as engine:
        for k, (x, y) in enumerate(DATA[:4]):
            engine.backward(model(x, y))
            if k == 1:
                engine.zero_grad()  # as torch: the gradients are dropped...
                engine.step()       # ...and this step changes nothing
                continue
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    assert_same(want, got, exact=True)


def test_an_interrupted_validation_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    config = cfg(rollback="snapshot")
    want = run(config, ["step"] * 3)
    real = stv.validate
    calls = {"n": 0}

    def flaky(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(stv, "validate", flaky)
    model = make_model(0)
    with so.initialize(model, HYPER, config) as engine:
        for k, (x, y) in enumerate(DATA[:3]):
            engine.backward(model(x, y))
            if k == 1:
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
                engine.zero_grad()
                engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    assert_same(want, got, exact=True)


def test_an_interruption_while_settling_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def half(sched: Any, flights: Any, v: Any, glob: Any) -> None:
        raise KeyboardInterrupt  # after the verdict, before every bucket was settled

    monkeypatch.setattr(stv, "settle", half)
    model = make_model(0)
    engine = so.initialize(model, HYPER, cfg())
    engine.backward(model(*DATA[0]))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    with pytest.raises(IterationInterrupted, match="load the last checkpoint"):
        engine.backward(model(*DATA[1]))
    engine.close()


def test_data_parallel_refuses_to_go_on_after_an_interrupted_backward() -> None:
    from superoffload.distributed import init_distributed, shutdown
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        model = make_model(0)
        engine = FsdpOffloadEngine(model, HYPER, cfg())
        hook = Interrupt(model, KeyboardInterrupt())  # on the sharded parameter
        hook.armed = True
        with pytest.raises(KeyboardInterrupt):
            engine.backward(model(*DATA[0]))
        with pytest.raises(IterationInterrupted, match="data parallel"):
            engine.step()
        engine.close()
    finally:
        shutdown()


def test_a_second_backward_before_step_is_refused_and_changes_nothing() -> None:
    config = cfg(rollback="snapshot")
    want = run(config, ["step"] * 2)
    model = make_model(0)
    with so.initialize(model, HYPER, config) as engine:
        for x, y in DATA[:2]:
            engine.backward(model(x, y))
            with pytest.raises(EngineError, match="grad_accum_steps=1"):
                engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    assert_same(want, got, exact=True)


def _hook_count(model: torch.nn.Module) -> int:
    n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return n + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_dropped_and_failed_engines_let_go_of_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(0)
    gc.collect()
    threads, hooks = threading.active_count(), _hook_count(model)
    for _ in range(10):  # dropped without close()
        engine = so.initialize(model, HYPER, cfg())
        engine.backward(model(*DATA[0]))
        engine.step()
        engine.zero_grad()
        del engine
    gc.collect()
    assert threading.active_count() == threads
    assert _hook_count(model) == hooks
    with monkeypatch.context() as m:  # a failed engine the user still holds
        m.setattr(steps.StepTask, "run", lambda self: 1 / 0)
        failed = so.initialize(model, HYPER, cfg(ratio=1.0))
        with pytest.raises(EngineError, match="ZeroDivisionError"):
            failed.backward(model(*DATA[0]))
            failed.step()
    assert _hook_count(model) == hooks and threading.active_count() == threads
    model.zero_grad(set_to_none=True)  # the failed iteration's gradients (as after torch)
    clone = copy.deepcopy(model)  # no lock, no thread in the model's hooks any more
    assert all(torch.equal(a, b) for a, b in zip(clone.parameters(), model.parameters()))
    fresh = make_model(0)
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), model.parameters()):
            p.copy_(q)
    want = {}
    with so.initialize(fresh, HYPER, cfg()) as ref:
        ref.backward(fresh(*DATA[1]))
        ref.step()
        want = ref.master_weights()
    with so.initialize(model, HYPER, cfg()) as engine:  # a new engine on the same model works
        engine.backward(model(*DATA[1]))
        engine.step()
        got = engine.master_weights()
        twin = copy.deepcopy(model)  # deepcopy while an engine is attached
        twin(*DATA[2]).backward()    # the copy's hooks do nothing for the copy
    assert_same(want, got, exact=True)
    del failed


def test_checkpoints_refuse_flipped_bytes_and_clean_orphans(tmp_path: Path) -> None:
    model = make_model(0)
    path = tmp_path / "ckpt"
    path.mkdir()
    orphan = path / "engine.pt.tmp-999999999"  # a save killed with SIGKILL (pid gone)
    orphan.write_bytes(b"half a file")
    with so.initialize(model, HYPER, cfg()) as engine:
        engine.backward(model(*DATA[0]))
        engine.step()
        engine.save_checkpoint(str(path))
        assert not orphan.exists()
        engine.load_checkpoint(str(path))  # intact: loads
        flip_tensor_byte(path / "engine.pt")
        with pytest.raises(CheckpointCorrupt, match="engine.pt is corrupt"):
            engine.load_checkpoint(str(path))


def test_a_failed_engine_does_not_create_a_checkpoint_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps.StepTask, "run", lambda self: 1 / 0)
    model = make_model(0)
    engine = so.initialize(model, HYPER, cfg(ratio=1.0))
    with pytest.raises(EngineError):
        engine.backward(model(*DATA[0]))
        engine.step()
    with pytest.raises(EngineError):
        engine.save_checkpoint(str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(("group", "field"), [
    ({"lr": float("nan")}, "lr"), ({"lr": float("inf")}, "lr"),
    ({"weight_decay": float("nan")}, "weight_decay"),
    ({"lr": 2.0, "weight_decay": 0.6}, "lr \\* weight_decay"),
])
def test_bad_hyper_parameters_fail_at_initialize(group: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        so.initialize(make_model(0), group, cfg())


def test_bad_models_and_settings_fail_at_initialize() -> None:
    model = make_model(0)
    with torch.no_grad():
        w = next(p for p in model.parameters() if p.dim() == 2)
        w.data = w.data.t().contiguous().t()  # same values, transposed strides
    with pytest.raises(ValueError, match="not contiguous"):
        so.initialize(model, HYPER, cfg())
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="sparse"):
        so.initialize(sparse, HYPER, cfg())
    with pytest.raises(ConfigError, match="watchdog_s"):
        cfg(watchdog_s=1e-9).validate()
