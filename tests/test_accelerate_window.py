"""An Accelerate loop whose data loader's length is not a multiple of the accumulation steps,
against plain Accelerate + torch.optim.AdamW (integrations/accumulation.py).

Plain Accelerate ends the last window at the loader's last batch and steps on its partial
sums (each loss divided by the accumulation steps, as always); `SuperOffloadAccelerator`
used to raise 9 steps in, from `clip_grad_norm_` ("still accumulating"), with advice
(`drop_last=True`) that cannot help. Now it takes the same step: two epochs of a ragged
loader, windows of 1 or 2 micro-batches short of 3, host or device accumulation, the loop of
the docs (`accumulate()`, clipping when `sync_gradients`) or a manual one. Tolerance 1e-6 on
the fp32 weights (measured 3e-8 to 6e-8: the op order of the Adam update and of the norm),
and the number of steps: every epoch ends with the short window's step. A loop without
`accumulate()` is told so at its first step, not that its loader is the cause.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="needs the 'hf' extra (accelerate)")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import superoffload as so
from superoffload.config import ConfigError
from superoffload.integrations.accelerate import SuperOffloadAccelerator

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
BATCH, CLIP, EPOCHS = 4, 0.3, 2
HYPER = {"lr": 3e-3, "weight_decay": 0.1}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))


def loader(micro_batches: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(micro_batches * BATCH, 16, generator=g), torch.randn(
        micro_batches * BATCH, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def accelerator(offload: bool, steps: int, accum_on: str = "device") -> Accelerator:
    AcceleratorState._reset_state(True)  # accelerate's process-wide singletons
    GradientState._reset_state()
    if offload:
        return SuperOffloadAccelerator(gradient_accumulation_steps=steps, cpu=True,
                                       offload_config=ENGINE.replace(grad_accum_on=accum_on))
    return Accelerator(gradient_accumulation_steps=steps, cpu=True)


def run(offload: bool, steps: int, micro_batches: int, loop: str,
        accum_on: str = "device") -> dict[str, Any]:
    acc = accelerator(offload, steps, accum_on)
    model = make_model()
    model, optimizer, data = acc.prepare(model, torch.optim.AdamW(model.parameters(), **HYPER),
                                         loader(micro_batches))
    norms: list[float] = []
    for _ in range(EPOCHS):
        for k, (x, y) in enumerate(data):
            if loop == "accumulate":  # the loop of the docs
                with acc.accumulate(model):
                    acc.backward(torch.nn.functional.mse_loss(model(x), y))
                    if acc.sync_gradients:
                        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                    optimizer.step()
                    optimizer.zero_grad()
            else:  # its own count, and a step at the loader's end too
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                if (k + 1) % steps == 0 or k + 1 == len(data):
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                    optimizer.step()
                    optimizer.zero_grad()
    engine = getattr(acc, "engine", None)
    weights = (engine.master_weights() if engine is not None else
               {k: v.detach().clone() for k, v in model.named_parameters()})
    out = {"weights": weights, "norms": norms,
           "steps": engine.stats.iterations if engine is not None else None}
    if engine is not None:
        engine.close()
    return out


@pytest.mark.parametrize("steps,micro_batches,loop,accum_on", [
    (2, 21, "accumulate", "device"),   # 10 whole windows and one of 1
    (3, 20, "accumulate", "device"),   # 6 whole windows and one of 2
    (3, 19, "accumulate", "host"),     # 6 whole windows and one of 1, host sums
    (3, 20, "manual", "device"),       # the loop counts and steps at the loader's end
])
def test_a_ragged_loader_steps_as_plain_accelerate(steps: int, micro_batches: int, loop: str,
                                                   accum_on: str) -> None:
    want = run(False, steps, micro_batches, loop)
    got = run(True, steps, micro_batches, loop, accum_on)
    windows = EPOCHS * -(-micro_batches // steps)  # the short window steps in every epoch
    assert len(want["norms"]) == windows
    assert got["steps"] == windows
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
    assert max(want["norms"]) > CLIP  # clipping fired
    diff = max(float((want["weights"][k] - got["weights"][k]).abs().max())
               for k in want["weights"])
    assert diff < 1e-6


@pytest.mark.parametrize("clip", [True, False])
def test_a_loop_without_accumulate_is_told_so_at_its_first_step(clip: bool) -> None:
    """Without `accumulate()` accelerate's `sync_gradients` stays True: the step asked for
    after one backward is the loop's doing, whatever the loader's length (here a multiple)."""
    acc = accelerator(True, 2)
    model = make_model()
    model, optimizer, data = acc.prepare(model, torch.optim.AdamW(model.parameters(), **HYPER),
                                         loader(8))
    before = acc.engine.master_weights()
    where = "clip_grad_norm_" if clip else r"optimizer\.step\(\)"
    with pytest.raises(ConfigError, match=rf"{where} with accelerator.sync_gradients=True after "
                       r"1 of 2 backward passes.*accelerator\.accumulate\(model\)") as info:
        for x, y in data:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    assert "drop_last" not in str(info.value) and "loader" not in str(info.value).split(
        "accumulate(model)")[0]
    assert acc.engine.stats.iterations == 0  # nothing stepped
    after = acc.engine.master_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    acc.free_memory()
