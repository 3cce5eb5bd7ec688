"""Hugging Face Accelerate + superoffload against Accelerate + torch.optim.AdamW.

An Accelerate user's loop (`prepare`, `accumulate`, `backward`, `clip_grad_norm_` when
`sync_gradients`, a transformers cosine schedule, `save_state` / `load_state`) on a small MLP
with dropout: 10 optimizer steps of accumulation 2 (20 micro-batches), clipping at 0.3 (it
fires). Tolerance 1e-6 on the fp32 weights (measured 3e-8: the op order of the Adam update
and of the norm). Whichever optimizer object the loop prepares -- the torch AdamW of any
Accelerate script, an engine's `engine.optimizer`, the Trainer integration's
`OffloadedOptimizer` -- and, for the latter two, with a plain `Accelerator` too: the
`OffloadedOptimizer` used to crash inside `prepare` with a transformers scheduler
("'OffloadedOptimizer' object has no attribute 'optimizer'") and, without one, to step on
every micro-batch (20 steps for 10).
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="needs the 'hf' extra (accelerate)")
transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import get_cosine_schedule_with_warmup  # noqa: E402

import superoffload as so  # noqa: E402
from superoffload.config import ConfigError  # noqa: E402
from superoffload.integrations.accelerate import SuperOffloadAccelerator  # noqa: E402
from superoffload.integrations.offloaded_optimizer import OffloadedOptimizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
STEPS, ACCUMULATION, BATCH, CLIP = 10, 2, 4, 0.3
HYPER = {"lr": 3e-3, "weight_decay": 0.1}


def fresh_state() -> None:
    """Accelerate keeps its state in process-wide singletons: one run's must not leak."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def make_model(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))


def loader(micro_batches: int = STEPS * ACCUMULATION) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(micro_batches * BATCH, 16, generator=g), torch.randn(
        micro_batches * BATCH, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def make_optimizer(kind: str, model: torch.nn.Module) -> tuple[Any, Any]:
    """(the object the loop prepares, the engine the user built or None)."""
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), **HYPER), None
    engine = so.initialize(model, HYPER, ENGINE.replace(grad_accum_steps=ACCUMULATION))
    return (engine.optimizer if kind == "engine" else OffloadedOptimizer(engine)), engine


def accelerator(offload: bool, **kw: Any) -> Accelerator:
    fresh_state()
    if offload:
        return SuperOffloadAccelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True,
                                       offload_config=ENGINE, **kw)
    return Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True, **kw)


def train(acc: Accelerator, model: Any, optimizer: Any, data: Any, scheduler: Any,
          skip: int = 0) -> list[float]:
    """The loop of an Accelerate script; returns the clipped steps' gradient norms."""
    if skip:
        data = acc.skip_first_batches(data, skip)
    norms = []
    for x, y in data:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return norms


def run(kind: str, offload: bool) -> dict[str, Any]:
    acc = accelerator(offload)
    model = make_model()
    optimizer, engine = make_optimizer(kind, model)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=STEPS)
    model, optimizer, data, scheduler = acc.prepare(model, optimizer, loader(), scheduler)
    norms = train(acc, model, optimizer, data, scheduler)
    engine = engine or getattr(acc, "engine", None)
    if engine is None:
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    else:
        weights = engine.master_weights()
    out = {"weights": weights, "norms": norms, "lr": scheduler.get_last_lr(),
           "steps": engine.stats.iterations if engine is not None else None,
           "optimizer": optimizer, "model": model}
    if engine is not None:
        engine.close()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run("torch", offload=False)


@pytest.mark.parametrize("offload,kind", [(True, "torch"), (True, "engine"), (True, "offloaded"),
                                          (False, "engine"), (False, "offloaded")])
def test_matches_plain_accelerate_adamw(reference: dict[str, Any], offload: bool,
                                        kind: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "lr_scheduler.step() before ..."
        got = run(kind, offload)
    assert max_diff(reference["weights"], got["weights"]) < 1e-6
    assert got["steps"] == STEPS  # one optimizer step per accumulation, not per micro-batch
    assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert max(reference["norms"]) > CLIP  # clipping fired
    assert got["lr"] == pytest.approx(reference["lr"], rel=1e-12)
    if offload:
        assert isinstance(got["optimizer"], OffloadedOptimizer)


def test_save_state_and_load_state_resume_bit_identically(tmp_path: Path) -> None:
    """5 steps, `save_state`, new objects (another init, a scrambled RNG), `load_state`, the
    last 5 steps: the weights and the engine's fp32 masters equal the uninterrupted run's.
    Without dropout: the resumed data loader's new iterator draws its seed from the global
    RNG, so with dropout plain Accelerate + AdamW does not resume bit-identically either
    (4e-3 apart here, and the engine's run the same)."""
    def start(seed: int) -> tuple[Any, ...]:
        acc = accelerator(True)
        model = make_model(seed, dropout=0.0)
        optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
        scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                    num_training_steps=STEPS)
        return (acc, *acc.prepare(model, optimizer, loader(), scheduler))

    acc, model, optimizer, data, scheduler = start(0)
    train(acc, model, optimizer, data, scheduler)
    want, want_params = acc.engine.master_weights(), {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    want_lr = scheduler.get_last_lr()
    acc.free_memory()

    acc, model, optimizer, data, scheduler = start(0)
    half = STEPS // 2 * ACCUMULATION
    for k, (x, y) in enumerate(data):
        if k == half:
            break
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    acc.save_state(str(tmp_path / "state"))
    acc.free_memory()

    acc, model, optimizer, data, scheduler = start(7)  # another initialisation: overwritten
    acc.load_state(str(tmp_path / "state"))
    assert acc.engine.iteration == STEPS // 2
    train(acc, model, optimizer, data, scheduler, skip=half)
    got = acc.engine.master_weights()
    assert all(torch.equal(want[k], got[k]) for k in want)
    got_params = model.state_dict()
    assert all(torch.equal(want_params[k], got_params[k]) for k in want_params)
    assert scheduler.get_last_lr() == want_lr
    acc.free_memory()


def test_refusals_name_the_way(tmp_path: Path) -> None:
    # (a data loader whose length is not a multiple of the accumulation steps is trained as
    # plain Accelerate trains it: tests/test_accelerate_window.py)
    acc = accelerator(True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    model, optimizer, data = acc.prepare(model, optimizer, loader(21))
    with pytest.raises(ConfigError, match="clips by the global norm of all of them"):
        acc.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(ConfigError, match="clip_grad_norm_"):
        acc.clip_grad_value_(model.parameters(), 1.0)
    acc.free_memory()
    # fp16 autocast: its GradScaler would scale p.grad, which the engine replaces
    with pytest.raises(ConfigError, match="mixed_precision='fp16'.*use mixed_precision='bf16'"):
        accelerator(True, mixed_precision="fp16")
    # not Adam / AdamW
    acc = accelerator(True)
    model = make_model()
    with pytest.raises(ConfigError, match="runs Adam/AdamW"):
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # an engine built with other accumulation steps than the accelerator's
    engine = so.initialize(model, HYPER, ENGINE)
    with pytest.raises(ConfigError, match=r"grad_accum_steps=1 contradicts "
                       r"Accelerator\(gradient_accumulation_steps=2\)"):
        acc.prepare(model, engine.optimizer)
    # a torch optimizer over an engine's parameters: a second engine would fight the first
    with pytest.raises(ConfigError, match="belong to a live offload engine already"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    engine.close()


def test_an_adamw_flag_is_the_engines_to_honour_or_refuse() -> None:
    acc = accelerator(True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        acc.prepare(model, optimizer)


def _docs_example() -> str:
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text.split("## Hugging Face Accelerate", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/integrations.md: no python example under 'Hugging Face Accelerate'"
    return blocks[0]


def test_the_docs_example_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _docs_example()], cwd=tmp_path, text=True,
                          capture_output=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "10 optimizer steps, resumed exactly"
