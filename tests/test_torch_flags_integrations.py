"""torch.optim.AdamW's flags through Lightning and transformers.Trainer: honoured or refused
with the supported way (kernels/hyper.py; the kernels, CPUAdam and the engine:
tests/test_torch_flags.py).

* Lightning: ``configure_optimizers`` returning ``AdamW(maximize=True)`` trains as Lightning's
  own AdamW does (fp32, 1e-5, as tests/test_integrations_lightning.py); ``amsgrad=True`` is
  refused at ``fit()``, and so is ``amsgrad`` set on the module's optimizer mid-run.
* Trainer: ``optimizer_cls_and_kwargs=(AdamW, {"maximize": True})`` trains as Trainer's own
  AdamW (fp32, 1e-5); ``amsgrad=True`` there and any ``optim_args`` (which Trainer's AdamW
  does not read) are refused before the model is touched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _engine_ref import HYPER, max_diff
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)


# ------------------------------------------------------------------ Lightning
def _lightning():
    return pytest.importorskip("lightning.pytorch", reason="needs the 'lightning' extra")


def _module(pl: Any, flags: dict[str, Any], edit_at: int | None = None) -> Any:
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if edit_at is not None and batch_idx == edit_at:
                self.optimizers().optimizer.param_groups[0]["amsgrad"] = True
            return self.net(*batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.net.parameters(), **HYPER, **flags)

    return Module()


def _fit(pl: Any, module: Any, strategy: Any = None) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy or "auto",
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches(4), batch_size=None, shuffle=False)
    trainer.fit(module, loader)


def test_lightning_adamw_maximize_trains_as_lightning_does():
    pl = _lightning()
    from superoffload.integrations.lightning import SuperOffloadStrategy

    ref = _module(pl, {"maximize": True})
    _fit(pl, ref)
    got = _module(pl, {"maximize": True, "foreach": False})
    _fit(pl, got, SuperOffloadStrategy(ENGINE))
    named = {n: p.detach() for n, p in ref.net.named_parameters()}
    assert max_diff(named, {n: p.detach() for n, p in got.net.named_parameters()}) < 1e-5
    plain = _module(pl, {})
    _fit(pl, plain)
    assert max_diff(named, {n: p.detach() for n, p in plain.net.named_parameters()}) > 1e-3


def test_lightning_adamw_amsgrad_is_refused_at_fit_and_mid_run():
    pl = _lightning()
    from superoffload.integrations.lightning import SuperOffloadStrategy

    # at fit(), building the engine from the module's groups (before any step)
    with pytest.raises(ValueError, match=r"optimizer\[0\]\['amsgrad'\]=True: amsgrad=True is "
                                         r"not supported.*amsgrad=False"):
        _fit(pl, _module(pl, {"amsgrad": True}), SuperOffloadStrategy(ENGINE))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\]"):
        _fit(pl, _module(pl, {}, edit_at=2), SuperOffloadStrategy(ENGINE))


# ------------------------------------------------------------------ transformers.Trainer
def _trainer_parts():
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    def model() -> Any:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))

    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]

    def args(out: Any, **kw: Any) -> Any:
        return TrainingArguments(output_dir=str(out), per_device_train_batch_size=4,
                                 max_steps=4, learning_rate=3e-3, max_grad_norm=0.0,
                                 weight_decay=0.1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, disable_tqdm=True, **kw)

    return transformers, model, data, args


def test_trainer_optimizer_cls_and_kwargs_maximize_trains_as_trainer_does(tmp_path):
    transformers, model, data, args = _trainer_parts()
    from superoffload.integrations.hf import SuperOffloadTrainer

    custom = (torch.optim.AdamW, {"lr": 2e-3, "maximize": True, "fused": False})
    ref = transformers.Trainer(model=model(), args=args(tmp_path / "ref"), train_dataset=data,
                               optimizer_cls_and_kwargs=custom)
    ref.train()
    got = SuperOffloadTrainer(model=model(), args=args(tmp_path / "so"), train_dataset=data,
                              offload_config=ENGINE, optimizer_cls_and_kwargs=custom)
    got.train()
    assert got.engine.optimizer.param_groups[0]["maximize"] is True
    want = {n: p.detach() for n, p in ref.model.named_parameters()}
    assert max_diff(want, got.engine.master_weights()) < 1e-5


@pytest.mark.parametrize(("kw", "message"), [
    ({"optim_args": "amsgrad=True"}, "optim_args='amsgrad=True'.*optimizer_cls_and_kwargs"),
    ({"cls_kwargs": {"amsgrad": True}}, r"optimizer_cls_and_kwargs\)\['amsgrad'\]=True"),
])
def test_trainer_refuses_what_it_cannot_honour_before_touching_the_model(tmp_path, kw, message):
    _, model, data, args = _trainer_parts()
    from superoffload.integrations.hf import SuperOffloadTrainer

    cls_kwargs = kw.pop("cls_kwargs", None)
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    trainer = SuperOffloadTrainer(
        model=m, args=args(tmp_path, bf16=True, **kw), train_dataset=data,
        offload_config=ENGINE,
        optimizer_cls_and_kwargs=None if cls_kwargs is None else (torch.optim.AdamW, cls_kwargs))
    with pytest.raises((so.ConfigError, ValueError), match=message):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())  # not cast to bf16
