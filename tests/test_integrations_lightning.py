"""PyTorch Lightning + `SuperOffloadStrategy` against Lightning + AdamW (docs/integrations.md).

The tests' tiny GPT (tests/_tiny_models.py), 20 optimizer steps, `accumulate_grad_batches=2`,
`gradient_clip_val=0.5` (it fires), a per-step cosine LambdaLR. Tolerances as
tests/test_engine_diff.py: fp32 1e-5 against Lightning's own AdamW + clipping; bf16 weights
("bf16-true") 1e-3 against bf16 weights + fp32-master AdamW (tests/_engine_ref.py), and
`bf16-mixed` 1e-3 against Lightning's AMP. Skipped without the 'lightning' extra.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pl = pytest.importorskip(
    "lightning.pytorch",
    reason="needs the optional 'lightning' extra: pip install 'superoffload[lightning]'")

from _engine_ref import HYPER, max_diff, train_reference  # noqa: E402
from _tiny_models import batches, make_model  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import superoffload as so  # noqa: E402
from superoffload.integrations.lightning import SuperOffloadStrategy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS, GAS, CLIP = 20, 2, 0.5
ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)


def cosine(step: int) -> float:
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS))


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, cosine)


class Module(pl.LightningModule):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net = make_model(dtype=dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.net(x, y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.net.parameters(), **HYPER)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}


class Capture(Logger):
    """A logger that keeps what it is given (TensorBoard / W&B get the same calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))


class Masters(pl.Callback):
    """The engine's fp32 masters at the end of fit (the strategy closes it at teardown)."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        weights = trainer.strategy.engine.master_weights()  # named from the LightningModule
        self.weights = {k.removeprefix("net."): v for k, v in weights.items()}
        self.stats = trainer.strategy.engine.stats
        self.buckets = trainer.strategy.engine.bucket_plan.buckets


def fit(module: Module, data: list, *, strategy: Any = None, precision: str = "32-true",
        epochs: int = 1, callbacks: list[Any] | None = None, ckpt_path: str | None = None,
        logger: Any = False, root: Any = None, **kw: Any) -> pl.Trainer:
    kw.setdefault("accumulate_grad_batches", GAS)
    kw.setdefault("gradient_clip_val", CLIP)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy or "auto",
        precision=None if "plugins" in kw else precision, max_epochs=epochs,
        logger=logger, callbacks=callbacks or [],
        enable_checkpointing=bool(kw.pop("checkpoint", False)),
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=5,
        default_root_dir=root, **kw)
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def named(module: Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.net.named_parameters() if p.requires_grad}


def test_fp32_matches_lightning_adamw():
    data = batches(STEPS * GAS)
    ref = Module()
    fit(ref, data)
    got, masters = Module(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), callbacks=[masters])
    assert max_diff(named(ref), masters.weights) < 1e-5
    assert masters.stats.iterations == STEPS and masters.stats.clipped_steps > 0
    # the module's AdamW still carries the scheduled learning rate; it never stepped itself
    assert max_diff(named(got), masters.weights) == 0.0


def test_bf16_true_matches_master_weight_adamw():
    data = batches(STEPS * GAS)
    want = train_reference(make_model(dtype=torch.bfloat16), data, steps=STEPS, gas=GAS,
                           max_norm=CLIP, sched=schedule)
    got, masters = Module(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), precision="bf16-true",
        callbacks=[masters])
    assert max_diff(want, masters.weights) < 1e-3
    for name, p in got.net.named_parameters():  # device weights are bf16 of the masters
        assert torch.equal(p.detach(), masters.weights[name].to(torch.bfloat16)), name


def test_bf16_mixed_matches_lightning_amp():
    data = batches(STEPS * GAS)
    ref = Module()
    fit(ref, data, precision="bf16-mixed")
    got, masters = Module(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), precision="bf16-mixed",
        callbacks=[masters])
    assert max_diff(named(ref), masters.weights) < 1e-3


def test_checkpoint_at_epoch_end_resumes_bit_identically(tmp_path):
    data = batches(10 * GAS)  # one epoch = 10 optimizer steps; two epochs in all
    full, masters = Module(), Masters()
    fit(full, data, strategy=SuperOffloadStrategy(ENGINE), precision="bf16-true", epochs=2,
        callbacks=[masters, pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1,
                                                          every_n_epochs=1)],
        checkpoint=True, root=tmp_path)
    first = sorted(tmp_path.glob("epoch=0*.ckpt"))
    assert len(first) == 1
    state = torch.load(first[0], weights_only=True)["optimizer_states"][0]
    assert state["superoffload_engine"]["iteration"] == 10
    resumed, again = Module(), Masters()
    fit(resumed, data, strategy=SuperOffloadStrategy(ENGINE), precision="bf16-true", epochs=2,
        callbacks=[again], ckpt_path=str(first[0]))
    assert again.stats.iterations == masters.stats.iterations == 20
    assert all(torch.equal(masters.weights[k], again.weights[k]) for k in masters.weights)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))


def test_engine_metrics_reach_the_loggers():
    logger, masters = Capture(), Masters()
    fit(Module(), batches(STEPS * GAS), strategy=SuperOffloadStrategy(ENGINE), logger=logger,
        callbacks=[masters])
    ours = [m for m in logger.metrics if "superoffload/rollbacks" in m]
    assert len(ours) == STEPS // 5
    last = ours[-1]
    for key in ("tokens_per_s", "d2h_gbps_busy", "cpu_step_hidden_pct", "replays", "clipped_steps",
                "grad_norm"):
        assert f"superoffload/{key}" in last, key
    assert last["superoffload/tokens_per_s"] > 0 and last["superoffload/d2h_gbps_busy"] > 0
    # clipping is settled in step(); rollbacks count when the CPU lane has run them
    assert last["superoffload/clipped_steps"] == masters.stats.clipped_steps == STEPS
    assert 0 <= last["superoffload/rollbacks"] <= masters.stats.rollbacks


class CustomClipModule(Module):
    """configure_gradient_clipping overridden: clip harder, through Lightning's API."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


def test_configure_gradient_clipping_reaches_the_engine():
    data = batches(STEPS * GAS)
    ref = CustomClipModule()
    fit(ref, data, gradient_clip_val=None)
    got, masters = CustomClipModule(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), gradient_clip_val=None,
        callbacks=[masters])
    assert max_diff(named(ref), masters.weights) < 1e-5
    assert masters.stats.clipped_steps == STEPS


class HookClipModule(Module):
    """Clipping p.grad by hand in on_before_optimizer_step (plain Lightning allows it)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)


def test_manual_clip_in_a_hook_is_refused_naming_the_way():
    from superoffload.runtime.contract import GradientEdited

    with pytest.raises(GradientEdited, match="clip_grad_norm_"):
        fit(HookClipModule(), batches(4), strategy=SuperOffloadStrategy(ENGINE),
            gradient_clip_val=None)


class GradNormModule(Module):
    """Lightning's documented recipe for watching gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[dict[str, float]] = []
        self.kept: list[int] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        norms = grad_norm(self, norm_type=2)
        self.norms.append({k: float(v) for k, v in norms.items()})
        self.log_dict(norms)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % GAS == 0:  # after the step: gradients still on the device
            self.kept.append(sum(p.grad is not None for p in self.parameters()))


def test_grad_norm_recipe_logs_what_plain_lightning_logs():
    """`grad_norm(self, norm_type=2)` in on_before_optimizer_step: every parameter's norm and
    the total, each step, and what reaches the logger, equal plain Lightning's (rel 1e-4;
    the weights agree to 1e-5). The offloaded gradients used to be missing (p.grad None):
    0.269 logged for 0.892. Afterwards they are off the device again."""
    data = batches(STEPS * GAS)
    ref, ref_log = GradNormModule(), Capture()
    fit(ref, data, logger=ref_log)
    got, log, masters = GradNormModule(), Capture(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), logger=log, callbacks=[masters])
    assert len(got.norms) == len(ref.norms) == STEPS
    total = "grad_2.0_norm_total"
    for mine, theirs in zip(got.norms, ref.norms):
        assert mine.keys() == theirs.keys() and len(mine) == 1 + len(list(ref.parameters()))
        assert mine == pytest.approx(theirs, rel=1e-4)
    logged = [m[total] for m in log.metrics if total in m]
    assert len(logged) == STEPS // 5
    assert logged == pytest.approx([m[total] for m in ref_log.metrics if total in m], rel=1e-4)
    assert max_diff(named(ref), masters.weights) < 1e-5
    # after the hooks the offloaded gradients are off the device again: the tail's stay
    tail = {i for b in masters.buckets if b.on_device for i in b.param_indices}
    assert 0 < len(tail) < len(list(got.parameters()))
    assert got.kept == [len(tail)] * STEPS


class HookScaleModule(Module):
    """Halves one offloaded parameter's gradient in on_before_optimizer_step (an edit only
    the copy shown in p.grad receives)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.net.ln_f.weight.grad.mul_(0.5)


def test_an_edit_of_a_shown_offloaded_gradient_is_refused():
    """The gradients a hook sees in p.grad are copies: an edit of one would be lost, so it
    is refused like any edit (GradientEdited, the iteration rolled back), not dropped."""
    from superoffload.runtime.contract import GradientEdited

    with pytest.raises(GradientEdited, match="ln_f.weight"):
        fit(HookScaleModule(), batches(4), strategy=SuperOffloadStrategy(ENGINE),
            gradient_clip_val=None)


class BigLoss(Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1e3


def test_heavy_clipping_default_matches_lightning_adamw():
    """Clip ratio ~1e3 with the strategy's default configuration."""
    data = batches(STEPS * GAS)
    ref = BigLoss()
    fit(ref, data, gradient_clip_val=1.0)
    got, masters = BigLoss(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(so.OffloadConfig(device="cpu", cpu_threads=1)),
        gradient_clip_val=1.0, callbacks=[masters])
    scale = max(float(v.abs().max()) for v in named(ref).values())
    assert max_diff(named(ref), masters.weights) / scale < 1e-5


class ManualModule(Module):
    """Manual optimization: `manual_backward` and `opt.step()` reach the engine too."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = self.net(x, y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched.step()
        return loss


def test_manual_optimization_matches_lightning_adamw():
    data = batches(STEPS)
    ref = ManualModule()
    fit(ref, data, accumulate_grad_batches=1, gradient_clip_val=None)
    got, masters = ManualModule(), Masters()
    fit(got, data, strategy=SuperOffloadStrategy(ENGINE), accumulate_grad_batches=1,
        gradient_clip_val=None, callbacks=[masters])
    assert max_diff(named(ref), masters.weights) < 1e-5
    assert masters.stats.iterations == STEPS


class SGDModule(Module):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("module", "kw", "config", "message"), [
    (Module, {"plugins": [MixedPrecision("16-mixed", "cpu")]}, ENGINE, "16-true"),
    (SGDModule, {}, ENGINE, "SGD"),
    (Module, {"gradient_clip_algorithm": "value"}, ENGINE, "gradient_clip_algorithm"),
    (Module, {}, ENGINE.replace(max_grad_norm=2.0), r"Trainer\(gradient_clip_val\)"),
])
def test_refusals_name_the_setting(module, kw, config, message):
    with pytest.raises(so.ConfigError, match=message):
        fit(module(), batches(4), strategy=SuperOffloadStrategy(config), **kw)
