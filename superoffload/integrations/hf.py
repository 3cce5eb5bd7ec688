"""Hugging Face `transformers.Trainer` with the offload engine (docs/integrations.md).

    from superoffload.integrations.hf import SuperOffloadTrainer
    trainer = SuperOffloadTrainer(model=model, args=TrainingArguments(..., bf16=True,
                                  gradient_accumulation_steps=2, max_grad_norm=1.0),
                                  train_dataset=ds, offload_config=so.presets.gh200())
    trainer.train()                                   # or .train(resume_from_checkpoint=True)

How it hooks in -- the places transformers' and accelerate's own DeepSpeed integration uses
(docs/integrations.md, "Hugging Face `Trainer`"), nothing else:

* `create_optimizer` builds the engine from Trainer's own param groups (decay / no decay) and
  TrainingArguments' AdamW hyperparameters; `self.optimizer` becomes `OffloadedOptimizer`
  (integrations/offloaded_optimizer.py), a `torch.optim.Optimizer` whose groups are the
  engine's, so `create_scheduler` (any `lr_scheduler_type`) steps the engine's learning rate.
  It is marked as prepared so that `accelerator.prepare` neither wraps it nor round-trips its
  state (a full copy).
* `accelerator.backward` -> `engine.backward` (overlap, accumulation, fp16 loss scaling);
  `accelerator.clip_grad_norm_` -> no clipping: the engine clips with `max_grad_norm` inside
  its step (paper §4.3), as accelerate routes both calls to DeepSpeed's engine; it returns
  the engine's pre-clip norm of this step, so the logged `grad_norm` is the whole model's.
* Checkpoints: `optimizer.pt` is `engine.state_dict()` (fp32 masters, moments, step counts,
  loss scaler, STV state); `save_model` synchronizes first; Trainer's own `scheduler.pt`,
  `rng_state.pth` and `trainer_state.json` do the rest, so `resume_from_checkpoint`
  continues bit-identically. Each checkpoint's note, `<checkpoint>/EXPORT.md`, says how to
  export its fp32 masters as a Hugging Face folder (`superoffload.export_hf`, docs/export.md).
* Precision: with `bf16=True` / `fp16=True` the model's weights are cast to that dtype and the
  engine keeps fp32 masters on the host (DeepSpeed's behaviour; the point of offloading);
  accelerate's autocast stays on (fp32 softmax / norms / loss, as in Trainer's AMP).
  `low_precision_weights=False` keeps fp32 weights under autocast (bf16 only).
* `log` adds the engine's metrics (`superoffload/tokens_per_s`, `d2h_gbps_busy`,
  `cpu_step_hidden_pct`, `rollbacks`, ...: `telemetry.vocabulary`) to every training log, so
  TensorBoard / W&B callbacks receive them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

try:
    import accelerate  # noqa: F401  (transformers.Trainer needs it)
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "superoffload.integrations.hf needs transformers and accelerate: "
        "pip install 'superoffload[hf]'"
    ) from exc

from superoffload.config import ConfigError, OffloadConfig
from superoffload.integrations.bridge import EngineMetrics, backward, engine_config
from superoffload.integrations.offloaded_optimizer import OffloadedOptimizer
from superoffload.kernels.hyper import check_flags, torch_flags

ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                          "adamw_torch_xla", "adamw_torch_npu_fused"})
"""TrainingArguments.optim values the engine replaces (its kernel is AdamW, paper §4.6)."""


def deepspeed_for_trainer(ds: Mapping[str, Any], args: Any) -> dict[str, Any]:
    """A Trainer-style DeepSpeed dict as the engine takes it. "auto" gets the TrainingArguments
    value, as transformers fills a DeepSpeed config from its TrainingArguments; `optimizer` /
    `scheduler` sections whose params are all "auto" are dropped (Trainer builds both from
    TrainingArguments), explicit values are refused; `zero_optimization.reduce_bucket_size:
    "auto"` keeps the engine's bucket size (docs/integrations.md, "Hugging Face `Trainer`")."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in ds.items()}
    fills = {"gradient_accumulation_steps": args.gradient_accumulation_steps,
             "gradient_clipping": args.max_grad_norm,
             "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
             "train_batch_size":
                 args.per_device_train_batch_size * args.gradient_accumulation_steps}
    for key, value in fills.items():
        if out.get(key) == "auto":
            out[key] = value
    for section, flag in (("bf16", args.bf16), ("fp16", args.fp16)):
        if isinstance(out.get(section), dict) and out[section].get("enabled") == "auto":
            out[section]["enabled"] = bool(flag)
    for section, where in (("optimizer", "learning_rate, adam_beta1/2, adam_epsilon, weight_decay"),
                           ("scheduler", "lr_scheduler_type, warmup_steps")):
        params = dict(out.get(section, {}).get("params", {})) if section in out else {}
        explicit = {k: v for k, v in params.items() if v != "auto"}
        if explicit:
            key, value = next(iter(explicit.items()))
            raise ConfigError(
                f"DeepSpeed {section}.params.{key}={value!r}: under Trainer these come from "
                f"TrainingArguments ({where}); set them there and write \"auto\" here")
        if section == "optimizer":
            out.pop(section, None)
        # a scheduler section stays: from_deepspeed drops it with a notice naming the
        # schedule that runs instead (Trainer's lr_scheduler_type), never silently
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("reduce_bucket_size") == "auto":
        zero.pop("reduce_bucket_size")
    return out


class SuperOffloadTrainer(Trainer):
    """`transformers.Trainer` whose optimizer is the offload engine (see module docstring).

    `offload_config`: an OffloadConfig or a DeepSpeed dict as Trainer users write them
    ("auto" values, see `deepspeed_for_trainer`; default `OffloadConfig()`);
    its `max_grad_norm` and `grad_accum_steps` come from TrainingArguments (a contradiction
    is a ConfigError). `low_precision_weights`: cast the model to bf16/fp16 when
    TrainingArguments asks for it (default True). `engine_kwargs` go to `so.initialize`
    (e.g. `inline=True`, `profile=...`). The engine is `trainer.engine` once training started."""

    def __init__(self, *args: Any, offload_config: OffloadConfig | Mapping[str, Any] | None = None,
                 low_precision_weights: bool = True, engine_kwargs: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offload_config = offload_config
        self.low_precision_weights = low_precision_weights
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: Any = None
        self.engine_metrics: EngineMetrics | None = None
        if self.args.fp16 and not low_precision_weights:
            raise ConfigError(
                "TrainingArguments.fp16=True with low_precision_weights=False: fp16 autocast "
                "needs a gradient scaler on p.grad, which the engine replaces; keep "
                "low_precision_weights=True (fp16 weights, the engine's loss scaler) or use bf16"
            )

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator (re-made by hyperparameter search too), with the two calls
        accelerate routes to DeepSpeed's engine sent to ours."""
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._engine_backward  # type: ignore[method-assign]
        self.accelerator.clip_grad_norm_ = self._engine_clips  # type: ignore[method-assign]

    # ------------------------------------------------------------------ engine
    def weights_dtype(self) -> torch.dtype:
        """The dtype the model's trainable weights are trained in."""
        if self.low_precision_weights and self.args.bf16:
            return torch.bfloat16
        if self.low_precision_weights and self.args.fp16:
            return torch.float16
        return torch.float32

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Build the engine (once) from Trainer's param groups and AdamW hyperparameters."""
        if self.optimizer is not None:
            if not isinstance(self.optimizer, OffloadedOptimizer):
                raise ConfigError(
                    "SuperOffloadTrainer(optimizers=(...)): the engine owns the optimizer; set "
                    "learning_rate, adam_beta1/2, adam_epsilon and weight_decay in "
                    "TrainingArguments instead of passing an optimizer")
            return self.optimizer
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim not in ADAMW_OPTIMS:
            raise ConfigError(
                f"TrainingArguments.optim={optim!r}: the offload engine runs AdamW; use one of "
                f"{sorted(ADAMW_OPTIMS)} (the default 'adamw_torch' is fine)")
        # refusals first: nothing is cast yet
        hyper = self._adamw_hyper()
        import superoffload as so

        model = self.model if model is None else model
        dtype = self.weights_dtype()
        if dtype != torch.float32:
            # the trained weights only (DeepSpeed casts the whole module); buffers such as
            # rotary frequencies keep their precision. The engine keeps fp32 masters.
            for p in model.parameters():
                if p.requires_grad and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [g for g in (
            {"params": [p for n, p in named if n in decay],
             "weight_decay": self.args.weight_decay, **hyper},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, **hyper},
        ) if g["params"]]
        offload = self.offload_config
        # a dict or, as deepspeed=, a path
        if isinstance(offload, Mapping | str | os.PathLike):
            from superoffload import ds_keys

            offload = deepspeed_for_trainer(ds_keys.read(offload)[0], self.args)
        config = engine_config(
            offload, max_grad_norm=self.args.max_grad_norm,
            grad_accum_steps=self.args.gradient_accumulation_steps,
            names=("TrainingArguments.max_grad_norm",
                   "TrainingArguments.gradient_accumulation_steps"))
        if config.device == "auto":
            config = config.replace(device=self.args.device.type)
        self.engine = so.initialize(model, groups, config, **self.engine_kwargs)
        # under torchrun: FSDP2 sharded it
        if getattr(self.engine, "fsdp", None) is not None:
            # Trainer's path for a model that owns its placement and gradient reduction: no DDP
            self.is_distributed_loading_by_transformers = True
        self.engine_metrics = EngineMetrics(self.engine)
        self.optimizer = OffloadedOptimizer(self.engine)
        return self.optimizer

    def _adamw_hyper(self) -> dict[str, Any]:
        """AdamW's lr, betas, eps and flags as Trainer would build it: from TrainingArguments,
        or from ``Trainer(optimizer_cls_and_kwargs=(AdamW, {...}))`` (its own defaults then,
        as Trainer's); the engine honours or refuses each flag (kernels/hyper.py).
        ``optim_args`` is refused: Trainer's AdamW does not read it, and neither would we."""
        if self.args.optim_args:
            raise ConfigError(
                f"TrainingArguments.optim_args={self.args.optim_args!r}: Trainer's AdamW does not "
                "read optim_args, so the engine refuses them rather than ignore them; pass AdamW "
                "flags as Trainer(optimizer_cls_and_kwargs=(torch.optim.AdamW, {'maximize': "
                "True}))")
        custom = getattr(self, "optimizer_cls_and_kwargs", None)
        if custom is None:
            return {"lr": self.args.learning_rate, "eps": self.args.adam_epsilon,
                    "betas": (self.args.adam_beta1, self.args.adam_beta2)}
        cls, kwargs = custom
        if not (isinstance(cls, type) and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))):
            raise ConfigError(f"optimizer_cls_and_kwargs={cls!r}: the offload engine runs "
                              "AdamW; pass (torch.optim.AdamW, {...}) or Adam")
        defaults = cls([torch.zeros(1, requires_grad=True)], **kwargs).defaults
        # amsgrad=True: refused
        check_flags(defaults, "Trainer(optimizer_cls_and_kwargs)")
        return {"lr": defaults["lr"], "betas": tuple(defaults["betas"]), "eps": defaults["eps"],
                **torch_flags(defaults)}

    def _defer_fsdp_gradient_reduction(self) -> Any:
        """Trainer's no-sync for FSDP2 models: under torchrun the engine decides, per
        micro-step, whether FSDP2 reduces (distributed/fsdp/hooks.py)."""
        import contextlib

        return contextlib.nullcontext()

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.engine is None:
            raise RuntimeError("SuperOffloadTrainer: backward before the engine was built "
                               "(call trainer.train())")
        backward(self.engine, loss)

    def _engine_clips(self, parameters: Any, max_norm: float, norm_type: float = 2
                      ) -> torch.Tensor:
        """Trainer's clip (and, with `max_norm=inf`, its norm for the log): the engine clips
        with max_grad_norm inside its step; the value is this step's pre-clip norm over every
        bucket, as `clip_grad_norm_` returns it (the offloaded gradients are not in p.grad)."""
        if self.engine is None:
            raise RuntimeError("SuperOffloadTrainer: clip_grad_norm_ before the engine was "
                               "built (call trainer.train())")
        return torch.tensor(self.engine.grad_norm(), dtype=torch.float32)

    # ------------------------------------------------------------------ Trainer hooks
    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer's step; counts tokens for `superoffload/tokens_per_s`."""
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if self.engine_metrics is not None and isinstance(ids, torch.Tensor):
            self.engine_metrics.add_tokens(ids.numel())
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the engine's metrics to training logs (those with a `loss`)."""
        if self.engine_metrics is not None and "loss" in logs:
            metrics = self.engine_metrics.collect()
            norm = metrics.pop("superoffload/grad_norm", None)
            if norm is not None and logs.get("grad_norm") is None:
                logs["grad_norm"] = norm
            logs.update(metrics)
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluation; its forwards are kept out of the engine's timeline."""
        with self._quiet_engine():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with self._quiet_engine():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save, after the engine's in-flight weight updates have landed (under
        bf16/fp16, with a warning that fp32 masters exist and how to export them)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        self.engine.synchronize()
        # weight-flow: streamed blocks are fetched first
        with self.engine.resident_weights():
            super().save_model(output_dir, _internal_call)
        if not _internal_call and self.weights_dtype() != torch.float32:
            from superoffload.export import notes
            notes.warn_masters_exist(str(output_dir or self.args.output_dir), self.weights_dtype())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's, then <checkpoint>/EXPORT.md: how to export the fp32 masters."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.engine is not None and self.args.should_save:
            from superoffload.export import notes
            notes.write_trainer_note(output_dir, self.weights_dtype())

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's train; afterwards the model holds the final weights."""
        out = super().train(*args, **kwargs)
        if self.engine is not None:
            self.engine.synchronize()
        return out

    def close(self) -> None:
        """Stop the engine's threads (the model keeps its trained weights). Idempotent; the
        trainer cannot train on afterwards."""
        if self.engine is not None:
            self.engine.close()
            self.engine = self.engine_metrics = None

    def _quiet_engine(self) -> Any:
        import contextlib

        engine = self.engine

        @contextlib.contextmanager
        def quiet() -> Any:
            if engine is None:
                yield
                return
            engine.synchronize()
            recorder, was = engine.telemetry, engine.telemetry.enabled
            recorder.enabled = False
            try:
                yield
            finally:
                recorder.enabled = was

        return quiet()


__all__ = ["ADAMW_OPTIMS", "SuperOffloadTrainer", "deepspeed_for_trainer"]
