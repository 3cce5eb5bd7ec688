"""Accelerate + superoffload: which Adam the engine runs, and the gradient norm a loop logs.

Against plain Accelerate with the same torch optimizer, on a small MLP (no dropout), 6 steps
of accumulation 2. Tolerance 1e-6 on the fp32 weights (measured ~3e-8, the op order of the
Adam update; tests/test_integrations_accelerate.py states the same), 1e-5 relative on norms.
* `torch.optim.Adam(weight_decay=...)` is Adam with L2 (the decay added to the gradient),
  not AdamW; in torch AdamW is a subclass of Adam, so an `isinstance(opt, Adam)` test takes
  one for the other: the two runs differ by ~1e-4 here, well beyond the tolerance.
* `accelerator.clip_grad_norm_(model.parameters(), float("inf"))`, the way to read the norm
  without clipping (Trainer's too), returns the whole model's norm; it used to be refused.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="needs the 'hf' extra (accelerate)")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import superoffload as so
from superoffload.integrations.accelerate import SuperOffloadAccelerator

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
STEPS, ACCUMULATION, BATCH = 6, 2, 4
HYPER = {"lr": 3e-3, "weight_decay": 0.1}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(),
                               torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUMULATION * BATCH
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def run(offload: bool, optimizer_cls: type[torch.optim.Optimizer], clip: float
        ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """An Accelerate script's loop; returns the weights and the norms it logged."""
    AcceleratorState._reset_state(True)  # accelerate's process-wide singletons
    GradientState._reset_state()
    acc = (SuperOffloadAccelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True,
                                   offload_config=ENGINE) if offload
           else Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True))
    model = make_model()
    opt = optimizer_cls(model.parameters(), **HYPER)  # type: ignore[call-arg]
    model, opt, data = acc.prepare(model, opt, loader())
    norms = []
    for x, y in data:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    engine = getattr(opt, "engine", None)
    if engine is not None:
        weights = {k.removeprefix("module."): v for k, v in engine.master_weights().items()}
        engine.close()
    else:
        weights = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
    return weights, norms


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_prepare_runs_the_adam_the_script_built(optimizer_cls: type) -> None:
    want, want_norms = run(False, optimizer_cls, 0.3)
    got, norms = run(True, optimizer_cls, 0.3)
    assert max_diff(want, got) < 1e-6
    assert norms == pytest.approx(want_norms, rel=1e-5) and max(norms) > 0.3  # it clipped
    other = torch.optim.AdamW if optimizer_cls is torch.optim.Adam else torch.optim.Adam
    assert max_diff(run(False, other, 0.3)[0], got) > 1e-5  # the test tells them apart


def test_a_norm_read_without_clipping_is_the_whole_models() -> None:
    want, want_norms = run(False, torch.optim.AdamW, float("inf"))
    got, norms = run(True, torch.optim.AdamW, float("inf"))
    assert len(norms) == STEPS
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert max_diff(want, got) < 1e-6  # and nothing was clipped
