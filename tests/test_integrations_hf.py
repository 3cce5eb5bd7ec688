"""`transformers.Trainer` + superoffload against `Trainer` + AdamW (docs/integrations.md).

A tiny Llama (GQA, SwiGLU, untied head) built from a config, 20 optimizer steps, gradient
accumulation 2, clipping at 0.5 (it fires), cosine schedule with warm-up, evaluation at
step 10. Tolerances (max abs difference of fp32 master weights), as tests/test_engine_diff.py:
* fp32: 1e-5 (measured ~1e-7: the op order of the Adam update and of the norm);
* bf16 autocast over fp32 weights (`low_precision_weights=False`): 1e-3 (measured ~4e-5:
  last-bit differences of the fp32 weights flip bf16 roundings of the forward);
* bf16 weights (the default with `bf16=True`): 1e-3 against bf16 weights + fp32-master AdamW
  clipped on the fp32 gradients, the engine's own semantics (measured ~4e-5). Against
  Trainer's autocast the bf16 residual stream alone moves weights by ~6e-3 in this run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the 'hf' extra)")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import superoffload as so  # noqa: E402
from superoffload.integrations.hf import SuperOffloadTrainer  # noqa: E402
from superoffload.integrations.offloaded_optimizer import OffloadedOptimizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS, VOCAB, SEQ = 20, 64, 16
ENGINE = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)


def make_model(*, dropout: float = 0.0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         attention_dropout=dropout)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: Any, **overrides: Any) -> TrainingArguments:
    kw: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=0.5, weight_decay=0.1, logging_steps=5, save_strategy="no",
        eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=4, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def train_offload(out: Any, *, model: Any = None, resume: str | None = None,
                  callbacks: list[Any] | None = None, offload: Any = ENGINE,
                  low_precision_weights: bool = True, **overrides: Any) -> SuperOffloadTrainer:
    trainer = SuperOffloadTrainer(
        model=model or make_model(), args=arguments(out, **overrides),
        train_dataset=Tokens(80, 1), eval_dataset=Tokens(8, 2), callbacks=callbacks,
        offload_config=offload, low_precision_weights=low_precision_weights)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def masters(trainer: SuperOffloadTrainer) -> dict[str, torch.Tensor]:
    return trainer.engine.master_weights()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach().float() - b[k].float()).abs().max()) for k in a)


def losses(trainer: Any, key: str = "loss") -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e]


class MasterWeightAdamW(torch.optim.Optimizer):
    """Reference for bf16 weights: `torch.optim.AdamW` on fp32 masters, the gradient cast to
    fp32 and clipped there (what the engine and DeepSpeed's bf16 optimizer do)."""

    def __init__(self, groups: list[dict[str, Any]], max_norm: float, **hyper: Any) -> None:
        self.low = [g["params"] for g in groups]
        self.master = [[p.detach().float().clone().requires_grad_() for p in ps] for ps in self.low]
        self.inner = torch.optim.AdamW([{**g, "params": m} for g, m in zip(groups, self.master)],
                                       **hyper)
        self.max_norm = max_norm
        super().__init__(groups, self.inner.defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = outer["lr"]  # the scheduler drives the outer groups
        for ps, ms in zip(self.low, self.master):
            for p, m in zip(ps, ms):
                m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_([m for ms in self.master for m in ms], self.max_norm)
        self.inner.step()
        for ps, ms in zip(self.low, self.master):
            for p, m in zip(ps, ms):
                p.copy_(m)


class MasterWeightTrainer(Trainer):
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(self.model))
            named = list(self.model.named_parameters())
            self.optimizer = MasterWeightAdamW(
                [{"params": [p for n, p in named if n in decay],
                  "weight_decay": self.args.weight_decay},
                 {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                max_norm=0.5, lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                betas=(self.args.adam_beta1, self.args.adam_beta2))
        return self.optimizer


def test_fp32_matches_trainer_adamw(tmp_path):
    ref_model = make_model()
    ref = Trainer(model=ref_model, args=arguments(tmp_path / "ref"), train_dataset=Tokens(80, 1),
                  eval_dataset=Tokens(8, 2))
    ref.train()
    got = train_offload(tmp_path / "so")
    assert max_diff(dict(ref_model.named_parameters()), masters(got)) < 1e-5
    assert losses(got) == pytest.approx(losses(ref), rel=1e-5)
    assert losses(got, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), rel=1e-5)
    # Trainer's grad_norm column is the engine's pre-clip norm; clipping fired
    assert losses(got, "grad_norm") == pytest.approx(losses(ref, "grad_norm"), rel=1e-4)
    assert got.engine.stats.clipped_steps > 0 and got.engine.stats.iterations == STEPS
    assert got.lr_scheduler.get_last_lr() == pytest.approx(ref.lr_scheduler.get_last_lr())
    assert isinstance(got.optimizer, OffloadedOptimizer)


@pytest.mark.parametrize("gas", [2, 3])
def test_kept_gradients_accumulated_on_the_host_log_trainers_grad_norm(tmp_path, gas):
    """keep_device_grads=True with grad_accum_on="host" (each alone was exact): every logged
    grad_norm and the masters equal Trainer + AdamW's (the pair used to count earlier
    micro-steps again: a grad_norm 2-3x too large)."""
    run = dict(gradient_accumulation_steps=gas, max_steps=6, logging_steps=1)
    ref_model = make_model()
    ref = Trainer(model=ref_model, args=arguments(tmp_path / "ref", **run),
                  train_dataset=Tokens(80, 1), eval_dataset=Tokens(8, 2))
    ref.train()
    got = train_offload(tmp_path / "so", offload=ENGINE.replace(keep_device_grads=True,
                                                                grad_accum_on="host"), **run)
    assert got.engine.accum_on_host
    assert len(losses(got, "grad_norm")) == 6
    assert losses(got, "grad_norm") == pytest.approx(losses(ref, "grad_norm"), rel=1e-4)
    assert max_diff(dict(ref_model.named_parameters()), masters(got)) < 1e-5


class NormWatch:
    """Records what Trainer's own grad-norm helper returns each step (the value it logs; a
    callback or subclass reads the same)."""

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        out = super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]
        self.seen.append(None if out is None else float(out))  # type: ignore[attr-defined]
        return out


class WatchedTrainer(NormWatch, Trainer):
    seen: list[float | None] = []


class WatchedOffload(NormWatch, SuperOffloadTrainer):
    seen: list[float | None] = []


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_trainers_grad_norm_helper_returns_the_whole_models_norm(tmp_path, max_grad_norm):
    """Trainer's clip_grad_norm_ (or, without clipping, clip_grad_norm_(..., inf)) returns
    the engine's pre-clip norm over every bucket, step by step as plain Trainer's (rel 1e-4);
    it used to return None (the offloaded gradients are not in p.grad)."""
    run = dict(max_steps=4, logging_steps=1, max_grad_norm=max_grad_norm, eval_strategy="no")
    WatchedTrainer.seen, WatchedOffload.seen = [], []
    ref = WatchedTrainer(model=make_model(), args=arguments(tmp_path / "ref", **run),
                         train_dataset=Tokens(80, 1))
    ref.train()
    got = WatchedOffload(model=make_model(), args=arguments(tmp_path / "so", **run),
                         train_dataset=Tokens(80, 1), offload_config=ENGINE)
    got.train()
    assert len(got.seen) == len(ref.seen) == 4 and None not in ref.seen
    assert got.seen == pytest.approx(ref.seen, rel=1e-4)
    assert losses(got, "grad_norm") == pytest.approx(ref.seen, rel=1e-4)


def test_bf16_autocast_over_fp32_weights_matches_trainer_adamw(tmp_path):
    ref_model = make_model()
    Trainer(model=ref_model, args=arguments(tmp_path / "ref", bf16=True),
            train_dataset=Tokens(80, 1), eval_dataset=Tokens(8, 2)).train()
    got = train_offload(tmp_path / "so", bf16=True, low_precision_weights=False)
    assert got.engine.model_dtype == torch.float32
    assert max_diff(dict(ref_model.named_parameters()), masters(got)) < 1e-3


def test_bf16_weights_match_master_weight_adamw(tmp_path):
    ref_model = make_model()
    for p in ref_model.parameters():
        p.data = p.data.bfloat16()
    ref = MasterWeightTrainer(model=ref_model,
                              args=arguments(tmp_path / "ref", bf16=True, max_grad_norm=0),
                              train_dataset=Tokens(80, 1), eval_dataset=Tokens(8, 2))
    ref.train()
    names = {id(p): n for n, p in ref_model.named_parameters()}
    opt = ref.optimizer.optimizer  # accelerate's wrapper around MasterWeightAdamW
    want = {names[id(p)]: m for ps, ms in zip(opt.low, opt.master) for p, m in zip(ps, ms)}
    got = train_offload(tmp_path / "so", bf16=True)
    assert got.engine.model_dtype == torch.bfloat16
    weights = masters(got)
    assert max_diff(want, weights) < 1e-3
    for name, p in got.model.named_parameters():  # device weights: bf16 of the masters
        assert torch.equal(p.detach(), weights[name].to(torch.bfloat16)), name
    assert got.model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers untouched


def test_save_steps_checkpoint_resumes_bit_identically(tmp_path):
    kw: dict[str, Any] = dict(bf16=True, save_strategy="steps", save_steps=10)
    full = train_offload(tmp_path / "a", model=make_model(dropout=0.1), **kw)
    ckpt = tmp_path / "a" / "checkpoint-10"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert state["format"].startswith("superoffload-engine") and state["iteration"] == 10
    resumed = train_offload(tmp_path / "b", model=make_model(dropout=0.1), resume=str(ckpt), **kw)
    a, b = masters(full), masters(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert losses(resumed)[-2:] == losses(full)[-2:]  # the logs after the resume point
    assert resumed.engine.stats.iterations == full.engine.stats.iterations == STEPS


def test_weight_flow_evaluates_and_saves_the_streamed_weights(tmp_path):
    kw: dict[str, Any] = dict(max_steps=10, eval_steps=5, save_strategy="steps", save_steps=5)
    ref_model = make_model()
    Trainer(model=ref_model, args=arguments(tmp_path / "ref", **kw), train_dataset=Tokens(80, 1),
            eval_dataset=Tokens(8, 2)).train()
    got = train_offload(tmp_path / "so", offload=ENGINE.replace(weights="flow"), **kw)
    assert got.engine.weights.active == "flow"
    assert max_diff(dict(ref_model.named_parameters()), masters(got)) < 1e-5
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "so" / "checkpoint-10")
    assert max_diff(dict(saved.named_parameters()), masters(got)) == 0.0  # resident, not empty


def test_engine_metrics_reach_trainer_callbacks(tmp_path):
    seen: list[dict[str, float]] = []

    class Capture(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    trainer = train_offload(tmp_path, callbacks=[Capture()], eval_strategy="no")
    train_logs = [e for e in seen if "loss" in e]
    assert len(train_logs) == STEPS // 5
    last = train_logs[-1]
    for key in ("tokens_per_s", "d2h_gbps_busy", "cpu_step_hidden_pct", "rollbacks", "replays",
                "clipped_steps", "exposed_optimizer_ms", "iteration_ms"):
        assert f"superoffload/{key}" in last, key
    assert last["superoffload/tokens_per_s"] > 0 and last["superoffload/d2h_gbps_busy"] > 0
    assert 0.0 <= last["superoffload/cpu_step_hidden_pct"] <= 100.0
    # clipping is settled in step(); rollbacks count when the CPU lane has run them
    assert last["superoffload/clipped_steps"] == trainer.engine.stats.clipped_steps == STEPS
    assert 0 < last["superoffload/rollbacks"] <= trainer.engine.stats.rollbacks
    assert last["grad_norm"] > 0.5


def test_fp16_overflow_skips_the_step_and_the_scheduler(tmp_path):
    offload = ENGINE.replace(initial_scale_power=24, hysteresis=1)
    trainer = train_offload(tmp_path, fp16=True, offload=offload, eval_strategy="no")
    stats = trainer.engine.stats
    assert trainer.engine.model_dtype == torch.float16
    assert 0 < stats.skipped_steps < STEPS  # the loss scale fell until steps went through
    # accelerate's optimizer_step_was_skipped kept Trainer from stepping the scheduler
    assert trainer.lr_scheduler.last_epoch == STEPS - stats.skipped_steps


@pytest.mark.parametrize(("overrides", "offload", "message"), [
    ({"optim": "sgd"}, ENGINE, "TrainingArguments.optim"),
    ({}, ENGINE.replace(max_grad_norm=2.0), "TrainingArguments.max_grad_norm"),
    ({}, ENGINE.replace(grad_accum_steps=4), "TrainingArguments.gradient_accumulation_steps"),
    ({}, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, "optimizer.params.lr"),
    ({}, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}},
     "scheduler.params"),
])
def test_contradictions_name_the_setting(tmp_path, overrides, offload, message):
    with pytest.raises(so.ConfigError, match=message):
        train_offload(tmp_path, offload=offload, **overrides)


def test_trainer_style_deepspeed_config_with_auto_values(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
          "superoffload": {"device": "cpu", "bucket_bytes": 4096, "cpu_threads": 1}}
    path = tmp_path / "ds_config.json"  # Trainer's deepspeed= takes a path: so do we
    path.write_text(json.dumps(ds))
    from superoffload.ds_keys import DeepSpeedNotice

    with pytest.warns(DeepSpeedNotice, match="lr_scheduler_type"):  # never dropped silently
        trainer = train_offload(tmp_path, offload=str(path), bf16=True, max_steps=4,
                                eval_strategy="no")
    config = trainer.engine.config
    assert (config.ratio, config.grad_accum_steps, config.max_grad_norm) == (0.5, 2, 0.5)
    assert trainer.engine.model_dtype == torch.bfloat16 and trainer.engine.stats.iterations == 4


def test_fp16_autocast_without_fp16_weights_is_refused(tmp_path):
    with pytest.raises(so.ConfigError, match="low_precision_weights"):
        SuperOffloadTrainer(model=make_model(),
                            args=arguments(tmp_path, fp16=True, eval_strategy="no"),
                            train_dataset=Tokens(8, 1), low_precision_weights=False)


def test_optimizer_view_shares_the_engine_groups(tmp_path):
    trainer = train_offload(tmp_path, max_steps=2, eval_strategy="no")
    opt = trainer.optimizer
    assert opt.param_groups is trainer.engine.optimizer.param_groups
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": []})
    trainer.close()
    assert trainer.engine is None


def test_heavy_clipping_with_the_default_config_matches_trainer_adamw(tmp_path):
    """max_grad_norm=1e-4 (a clip ratio ~1e4) with the default OffloadConfig: the engine's
    default rollback stays within 1e-5 relative of Trainer + AdamW."""
    ref_model = make_model()
    Trainer(model=ref_model, args=arguments(tmp_path / "ref", max_grad_norm=1e-4),
            train_dataset=Tokens(80, 1), eval_dataset=Tokens(8, 2)).train()
    got = train_offload(tmp_path / "so", max_grad_norm=1e-4,
                        offload=so.OffloadConfig(device="cpu", cpu_threads=1))
    want = dict(ref_model.named_parameters())
    scale = max(float(p.detach().abs().max()) for p in want.values())
    assert max_diff(want, masters(got)) / scale < 1e-5
    assert got.engine.stats.clipped_steps == STEPS
