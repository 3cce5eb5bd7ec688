"""FSDP2 at the engine's edge (distributed/fsdp/fsdp_engine.py, hooks.py; docs/distributed.md).

The FSDP2 engine applies FSDP2 to the model outside the step: it sets up the units, and its
unit hooks (a publish wait, the gradient-sync rule, which parameters a rank used) go on and
come off with the engine's own hooks. At world size 1, in this process:

* a frozen parameter inside a unit, and a param group added mid-run, train bit for bit as in
  one process (the unit hooks watch every trained parameter, whatever the buckets);
* a failed engine lets go of the model at once, as one process does: no hook of it is left
  (weight-flow's teardown, which resets FSDP2's prefetch, puts none back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _engine_ref import HYPER
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import OffloadConfig
from superoffload.runtime import steps
from superoffload.runtime.errors import EngineError
from superoffload.runtime.hook_base import PicklableHook

CFG = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.7, max_grad_norm=0.3,
                    cpu_threads=1, telemetry=False)


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[None]:
    """A one-rank gloo group in this process (the data-parallel engine at world size 1)."""
    from superoffload.distributed import init_distributed, shutdown

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        yield
    finally:
        shutdown()


def _fsdp(model: torch.nn.Module, groups: Any, config: OffloadConfig) -> Any:
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    return FsdpOffloadEngine(model, groups, config)


def _engine_hooks(model: torch.nn.Module) -> list[str]:
    """The engine hooks (runtime/hook_base.py) left on ``model``'s modules and parameters."""
    found = []
    for name, module in model.named_modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            found += [f"{name}: {type(h).__name__}" for h in hooks.values()
                      if isinstance(h, PicklableHook)]
    for name, p in model.named_parameters():
        found += [f"{name}: {type(h).__name__}"
                  for h in (p._post_accumulate_grad_hooks or {}).values()
                  if isinstance(h, PicklableHook)]
    return found


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def test_a_frozen_parameter_and_an_added_group_train_as_in_one_process(
        gloo_world: None) -> None:
    data = batches(6, seed=3, batch=4, seq=12)
    out = []
    for build in (so.initialize, _fsdp):
        model = make_model(0, frozen=True)  # a frozen layer in the root unit
        model.blocks[1].ln.requires_grad_(False)  # and one inside a block unit
        late = [model.blocks[2].fc2.weight, model.blocks[2].fc2.bias]
        first = [p for p in model.parameters()
                 if p.requires_grad and not any(p is q for q in late)]
        with build(model, [{"params": first, **HYPER}], CFG) as engine:
            for step, (x, y) in enumerate(data):
                if step == 2:  # the late group trains from the next step, fresh moments
                    late_now = [p for n, p in model.named_parameters()
                                if n.startswith("blocks.2.fc2.")]
                    engine.optimizer.add_param_group({"params": late_now, **HYPER})
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
                model.zero_grad(set_to_none=True)  # the late group's gradient before it joins
            out.append((engine.master_weights(), engine.stats.as_dict(),
                        {n: _full(p).detach().clone() for n, p in model.named_parameters()
                         if not p.requires_grad}))
    (single, s_stats, s_frozen), (fsdp, f_stats, f_frozen) = out
    assert "blocks.2.fc2.weight" in single and "frozen.weight" not in single
    assert single.keys() == fsdp.keys()
    assert s_stats == f_stats
    for name in single:
        assert torch.equal(single[name], fsdp[name]), name
    assert s_frozen.keys() == f_frozen.keys() and "blocks.1.ln.weight" in s_frozen
    for name in s_frozen:  # untouched by both
        assert torch.equal(s_frozen[name], f_frozen[name]), name


@pytest.mark.parametrize("weights", ["stationary", "flow"])
def test_a_failed_engine_lets_go_of_the_model_as_in_one_process(
        weights: str, monkeypatch: pytest.MonkeyPatch, gloo_world: None) -> None:
    def boom(self: Any) -> bool:
        raise RuntimeError("kernel exploded")

    for build in (so.initialize, _fsdp):
        model = make_model(0)
        engine = build(model, HYPER, CFG.replace(ratio=1.0, weights=weights))
        assert _engine_hooks(model)  # the hooks are on while it trains
        with monkeypatch.context() as m:
            m.setattr(steps.StepTask, "run", boom)
            with pytest.raises(EngineError, match="kernel exploded"):
                for x, y in batches(3, seed=1, batch=4, seq=12):
                    engine.backward(model(x, y))
                    engine.step()
        assert _engine_hooks(model) == [], type(engine).__name__  # before close()
        engine.close()
        assert _engine_hooks(model) == [], type(engine).__name__
