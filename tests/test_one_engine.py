"""One engine: the single-process and the data-parallel (FSDP2) engine are one
iteration core.

* a trainable parameter that never gets a gradient is left untouched by both (as
  ``torch.optim.AdamW`` leaves it);
* the FSDP2 engine at world size 1 is bit-identical to the single-process engine over 20 steps with
  clipping, a skipped non-finite step and gradient accumulation;
* both raise the same error type for the same fault and behave alike on ``close()``;
* the schedule the engine runs is the rule book's (``plan.schedule.resolve_schedule``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, groups_for
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import OffloadConfig
from superoffload.plan.schedule import ENGINE, ScheduleFacts, resolve_schedule
from superoffload.runtime import steps
from superoffload.runtime.errors import EngineError
from superoffload.runtime.transfers import H2DTask
from superoffload.threads import usable_cores


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[None]:
    """A one-rank gloo group in this process (the data-parallel engine at world size 1)."""
    from superoffload.distributed import init_distributed, shutdown

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        yield
    finally:
        shutdown()


def _fsdp(model: torch.nn.Module, groups: Any, config: OffloadConfig, **kw: Any) -> Any:
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    return FsdpOffloadEngine(model, groups, config, **kw)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a full tensor (FSDP2's are DTensor shards)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


class WithIdle(torch.nn.Module):
    """A tiny model plus a trainable layer the loss never uses (its .grad stays None)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(8, 8)
        self.idle = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.idle.weight.fill_(1.0)
            self.idle.bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


CFG = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.5, cpu_threads=1, telemetry=False)


def _train_idle(engine: Any, model: WithIdle, steps_n: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps_n):
        engine.backward(model(torch.randn(4, 8)))
        engine.step()
        engine.zero_grad()


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_a_parameter_without_gradient_is_untouched_by_both_engines(ratio: float,
                                                                   gloo_world: None) -> None:
    ref = WithIdle()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    torch.manual_seed(1)
    for _ in range(3):
        ref(torch.randn(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(ref.idle.weight, torch.ones(8, 8))  # AdamW skips grad=None
    cfg = CFG.replace(ratio=ratio)
    for build in (lambda m: so.initialize(m, HYPER, cfg), lambda m: _fsdp(m, HYPER, cfg)):
        model = WithIdle()
        with build(model) as engine:
            _train_idle(engine, model)
            masters = engine.master_weights()
            assert engine.state.steps[engine.state.names.index("idle.weight")] == 0
            assert engine.state.steps[engine.state.names.index("used.weight")] == 3
        assert torch.equal(masters["idle.weight"], torch.ones(8, 8)), type(engine).__name__
        assert torch.equal(_full(model.idle.bias), torch.ones(8))
        torch.testing.assert_close(masters["used.weight"], ref.used.weight, rtol=0, atol=1e-6)


def _run_20(engine: Any, model: torch.nn.Module, data: list, nan_step: int) -> None:
    gas = engine.config.grad_accum_steps
    for step in range(20):
        for micro in range(gas):
            x, y = data[step * gas + micro]
            loss = model(x, y)
            if step == nan_step and micro == gas - 1:
                loss = loss * float("nan")  # every gradient non-finite: the step is skipped
            engine.backward(loss)
            engine.step()
        engine.zero_grad()


@pytest.mark.parametrize(("rollback", "moments"),
                         [("inverse", "fp32"), ("snapshot", "fp32"), ("snapshot", "bf16")])
def test_fsdp_at_world_size_one_is_bit_identical_over_20_steps(rollback: str, moments: str,
                                                               gloo_world: None) -> None:
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.7, max_grad_norm=0.3,
                        grad_accum_steps=2, rollback=rollback, speculation="on",
                        cpu_threads=1, telemetry=False, optimizer_state_dtype=moments)
    data = batches(40, seed=3, batch=4, seq=12)
    out = []
    for build in (so.initialize, _fsdp):
        model = make_model(0)
        with build(model, groups_for(model, True, HYPER), cfg) as engine:
            _run_20(engine, model, data, nan_step=7)
            out.append((engine.master_weights(), engine.stats.as_dict(), engine.schedule))
    (single, s_stats, s_sched), (fsdp, z_stats, z_sched) = out
    assert s_stats["skipped_steps"] == z_stats["skipped_steps"] == 1
    assert s_stats["clipped_steps"] == z_stats["clipped_steps"] > 10  # the replay path ran
    assert s_stats == z_stats
    assert s_sched.bucket_table() == z_sched.bucket_table()
    assert single.keys() == fsdp.keys()
    for name in single:
        assert torch.equal(single[name], fsdp[name]), name


def _fail_after_step_returns(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The first weight publish (H2D, both engines) fails, but only once the test says so:
    a failure that no engine call has reported yet."""
    go = threading.Event()

    def late_failure(self: Any) -> Any:
        go.wait(30)
        raise OSError("link down after the step")

    monkeypatch.setattr(H2DTask, "run", late_failure)
    return go


def test_both_engines_raise_one_error_type_and_close_alike(
        monkeypatch: pytest.MonkeyPatch, gloo_world: None) -> None:
    def boom(self: Any) -> bool:
        raise RuntimeError("kernel exploded")

    builders = {"single": so.initialize, "fsdp": _fsdp}
    with monkeypatch.context() as m:
        m.setattr(steps.StepTask, "run", boom)
        for name, build in builders.items():
            model = make_model(0)
            engine = build(model, HYPER, CFG.replace(ratio=1.0))
            with pytest.raises(EngineError, match="cpu_worker lane failed.*kernel exploded"):
                for x, y in batches(3, seed=1, batch=4, seq=12):
                    engine.backward(model(x, y))
                    engine.step()
            with pytest.raises(EngineError):  # and it stays raised
                engine.step()
            engine.close()  # reported already: close() is quiet, and idempotent
            engine.close()
            assert all(not getattr(lane, "alive", False) for lane in engine.lanes), name
            with pytest.raises(EngineError, match="closed"):
                engine.step()
    for name, build in builders.items():  # a failure nobody saw yet: close() raises it
        with monkeypatch.context() as m:
            go = _fail_after_step_returns(m)
            model = make_model(0)
            engine = build(model, HYPER, CFG.replace(ratio=1.0))
            x, y = batches(1, seed=1, batch=4, seq=12)[0]
            engine.backward(model(x, y))
            engine.step()
            go.set()
            with pytest.raises(EngineError, match="link down after the step"):
                engine.close()
            engine.close()  # the second close is quiet: the error was reported once
            assert all(not getattr(lane, "alive", False) for lane in engine.lanes), name


@pytest.mark.parametrize("weights", ["stationary", "flow"])
def test_the_engine_runs_the_rule_books_schedule(weights: str) -> None:
    model = make_model(0)
    cfg = CFG.replace(ratio=0.5, weights=weights)
    with so.initialize(model, HYPER, cfg) as engine:
        facts = ScheduleFacts(params=engine.state.param_specs(), model_dtype="float32",
                              device_type="cpu", usable_cores=usable_cores(),
                              engine=ENGINE)  # what the engine runs (plan/schedule.py)
        want = resolve_schedule(cfg, facts)
        got = engine.schedule
        assert got.bucket_table() == want.bucket_table()
        assert got.ratio == want.ratio == (1.0 if weights == "flow" else 0.5)
        assert got.threads == want.threads
        x, y = batches(1, seed=1, batch=4, seq=12)[0]
        engine.backward(model(x, y))
        engine.step()
        ratio = [s.value for s in engine.telemetry.scalars("ratio")] if cfg.telemetry else None
    rec_cfg = cfg.replace(telemetry=True)
    model = make_model(0)
    with so.initialize(model, HYPER, rec_cfg) as engine:  # telemetry records the effective one
        x, y = batches(1, seed=1, batch=4, seq=12)[0]
        engine.backward(model(x, y))
        engine.step()
        ratio = [s.value for s in engine.telemetry.scalars("ratio")]
    assert ratio == [1.0 if weights == "flow" else 0.5]
    if weights == "flow":
        notes = " ".join(n.text for n in engine.telemetry.notes())
        assert "ratio 0.5 -> 1" in notes


@pytest.mark.parametrize("weights", ["stationary", "flow"])
def test_the_planner_predicts_the_schedule_the_engine_runs(weights: str) -> None:
    """The simulator's resolved schedule (plan.techniques.resolve, what ``simulate`` runs) for
    ``ModelShape.from_module(model)``: the engine's effective ratio, offloaded elements and
    bucket table, for weight-stationary and weight-flow."""
    from superoffload import plan
    from superoffload.plan.techniques import Techniques, resolve

    model = make_model(0)
    cfg = CFG.replace(ratio=0.5, weights=weights, bucket_bytes=8192)
    with so.initialize(model, HYPER, cfg) as engine:
        got = engine.schedule
    shape = plan.ModelShape.from_module(model, seq=12, micro_batch=4)
    prof = plan.profiles.get("cpu-laptop")
    want = resolve(shape, prof, "superoffload", cfg, Techniques(engine=ENGINE))
    assert want.ratio == got.ratio == (1.0 if weights == "flow" else 0.5)
    assert want.host_numel == got.host_numel and want.device_numel == got.device_numel
    assert [(b.param_indices, b.numel, b.on_device) for b in want.bucket_plan.buckets] == \
        [(p, n, d) for _, p, n, d in got.bucket_table()]
