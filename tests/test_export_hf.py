"""`export_hf` with Hugging Face `Trainer` runs (`SuperOffloadTrainer`) and peft adapters
(docs/export.md, "Sources" and "peft").

A tiny GPT-2 (tied head) trained 6 steps with `bf16=True`: the model's weights are bf16,
the engine keeps fp32 masters. The reference is the masters themselves (in `optimizer.pt` or
`trainer.engine`): the export, loaded back with `from_pretrained` (or peft's
`PeftModel.from_pretrained`), must equal them bit for bit. The checkpoint's own
model.safetensors (bf16) differs from them (checked: the control that the comparison can
fail).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the 'hf' extra)")

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

import superoffload as so  # noqa: E402
from superoffload.export import export_hf  # noqa: E402
from superoffload.integrations.hf import SuperOffloadTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
VOCAB, SEQ, STEPS = 64, 16, 6
ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)


def make_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: Path, model: Any, **overrides: Any) -> SuperOffloadTrainer:
    kw: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=STEPS,
        learning_rate=1e-2, bf16=True, save_strategy="steps", save_steps=3, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, logging_steps=3)
    kw.update(overrides)
    trainer = SuperOffloadTrainer(model=model, args=TrainingArguments(**kw),
                                  train_dataset=Tokens(32), offload_config=ENGINE)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("trainer")
    trainer = train(out, make_model())
    yield trainer, out
    trainer.close()


def saved_masters(ckpt: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(ckpt / "optimizer.pt", weights_only=True)
    return {k: s["master"] for k, s in payload["state"].items()}


def test_a_trainer_checkpoint_loads_with_from_pretrained_as_its_masters(run: Any,
                                                                         tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _, out = run
    ckpt = out / f"checkpoint-{STEPS}"
    report = export_hf(ckpt, tmp_path / "model")
    assert report.source == f"Trainer checkpoint {ckpt}"
    assert report.config_from == str(ckpt / "config.json")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again
    masters, sd = saved_masters(ckpt), model.state_dict()
    assert sorted(masters) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(sd[k], v) for k, v in masters.items())
    # the control: what Trainer saved as the model is bf16, off the masters (the tied
    # embedding included: the "natural recipe" of loading it loses this much)
    bf16 = load_file(str(ckpt / "model.safetensors"))
    wte = "transformer.wte.weight"
    assert bf16[wte].dtype == torch.bfloat16
    off = float((bf16[wte].float() - masters[wte]).abs().max())
    assert 1e-5 < off < 1e-2  # measured 2.3e-4


def test_a_bf16_export_rounds_each_master_once(run: Any, tmp_path: Path) -> None:
    _, out = run
    ckpt = out / f"checkpoint-{STEPS}"
    export_hf(ckpt, tmp_path / "model", dtype="bf16")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "model", dtype="auto")
    assert model.dtype == torch.bfloat16
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v.to(torch.bfloat16)) for k, v in saved_masters(ckpt).items())
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_every_trainer_checkpoint_says_how_to_export_it(run: Any, tmp_path: Path) -> None:
    from superoffload.cli import main

    _, out = run
    ckpt = out / "checkpoint-3"
    note = (ckpt / "EXPORT.md").read_text()
    assert "(bfloat16)" in note and "optimizer.pt" in note
    command = next(line.split("#")[0].split() for line in note.splitlines()
                   if "--dtype" not in line and "superoffload export" in line)
    assert command[:5] == ["python", "-m", "superoffload", "export", str(ckpt)]
    # the command it gives works
    assert main(["export", str(ckpt), str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_save_model_under_bf16_says_fp32_masters_exist(run: Any, tmp_path: Path) -> None:
    trainer, _ = run
    with pytest.warns(UserWarning, match="save_model wrote bfloat16 weights .* fp32 master "
                                         r"weights, which are exact: superoffload\.export_hf"):
        trainer.save_model(str(tmp_path / "saved"))


def test_save_model_of_an_fp32_run_says_nothing(tmp_path: Path) -> None:
    trainer = train(tmp_path / "fp32", make_model(), bf16=False, max_steps=1, save_strategy="no")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            trainer.save_model(str(tmp_path / "saved"))
    finally:
        trainer.close()


def test_a_live_trainer_exports_the_engines_masters(run: Any, tmp_path: Path) -> None:
    trainer, _ = run
    masters = trainer.engine.master_weights()
    export_hf(trainer, tmp_path / "model")
    sd = GPT2LMHeadModel.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(sd[k], v) for k, v in masters.items())
    # the same as the last checkpoint's export (both are the masters after step 6)
    assert all(torch.equal(v, saved_masters(run[1] / f"checkpoint-{STEPS}")[k])
               for k, v in masters.items())


# ---------------------------------------------------------------- peft
@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Any:
    peft = pytest.importorskip("peft", reason="the 'peft' extra")
    torch.set_num_threads(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                             fan_in_fan_out=True)
    model = peft.get_peft_model(make_model(), config)
    out = tmp_path_factory.mktemp("lora")
    trainer = train(out, model)
    yield peft, trainer, out
    trainer.close()


def adapter_reference(peft: Any, trainer: SuperOffloadTrainer, tmp: Path) -> dict[str, Any]:
    """The keys peft's own save_pretrained writes, and the masters under them."""
    trainer.model.save_pretrained(tmp)
    from safetensors.torch import load_file

    keys = sorted(load_file(str(tmp / "adapter_model.safetensors")))
    masters = trainer.engine.master_weights()
    return {"keys": keys, "masters": masters}


def test_a_live_peft_run_exports_its_adapter_from_the_masters(lora: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    peft, trainer, _ = lora
    ref = adapter_reference(peft, trainer, tmp_path / "peft_own")
    report = export_hf(trainer, tmp_path / "adapter")
    assert report.files == ("adapter_model.safetensors",)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == ref["keys"]  # peft's own key names
    trained = {k: v for k, v in ref["masters"].items() if "lora_" in k}
    assert len(trained) == len(got) == 4  # lora_A and lora_B of 2 layers
    for name, master in trained.items():
        assert torch.equal(got[name.replace(".default.", ".")], master)
    # peft loads it onto a fresh base model: every LoRA weight is the fp32 master
    loaded = peft.PeftModel.from_pretrained(make_model(), str(tmp_path / "adapter"))
    params = dict(loaded.named_parameters())
    assert all(torch.equal(params[k].float(), v) and params[k].dtype == torch.float32
               for k, v in trained.items())


def test_a_peft_trainer_checkpoint_exports_its_adapter_from_the_masters(
        lora: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    peft, _, out = lora
    ckpt = out / f"checkpoint-{STEPS}"
    export_hf(ckpt, tmp_path / "adapter")
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    saved = load_file(str(ckpt / "adapter_model.safetensors"))  # Trainer's, bf16
    assert sorted(got) == sorted(saved)
    masters = saved_masters(ckpt)
    assert len(masters) == len(got)
    for name, master in masters.items():
        key = name.replace(".default.", ".")
        assert torch.equal(got[key], master)
        assert saved[key].dtype == torch.bfloat16  # the control: Trainer wrote bf16
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())[
        "peft_type"] == "LORA"
    peft.PeftModel.from_pretrained(make_model(), str(tmp_path / "adapter"))


def test_an_adapter_that_would_lose_a_trained_tensor_is_refused(lora: Any,
                                                                tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    _, _, out = lora
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / f"checkpoint-{STEPS}", ckpt)
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    dropped = sorted(saved)[0]
    del saved[dropped]  # an adapter file that lacks one trained tensor's key
    save_file(saved, str(ckpt / "adapter_model.safetensors"), metadata={"format": "pt"})
    master = dropped.replace(".weight", ".default.weight")  # its name in the engine
    with pytest.raises(ValueError, match=r"trained parameter\(s\) \['" + re.escape(master)):
        export_hf(ckpt, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
