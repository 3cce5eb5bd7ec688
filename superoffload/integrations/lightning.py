"""PyTorch Lightning with the offload engine: a strategy (docs/integrations.md).

    from superoffload.integrations.lightning import SuperOffloadStrategy
    trainer = L.Trainer(strategy=SuperOffloadStrategy(so.presets.gh200()), precision="bf16-true",
                        accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=1000)
    trainer.fit(module)            # the LightningModule is unchanged: configure_optimizers
                                   # returns torch.optim.AdamW (or Adam) and any LR scheduler

Like Lightning's own `DeepSpeedStrategy` (docs/integrations.md, "PyTorch Lightning"), the
strategy takes the optimizer `configure_optimizers` returns and hands its parameter groups
and hyperparameters to the engine; the module's AdamW object stays what Lightning and the LR
schedulers see, and its groups' lr / betas / eps / weight_decay and AdamW flags are copied
into the engine's before every backward and step, so any scheduler drives the engine. Its own
`step` is never called (it holds no state). The flags (`maximize`, `amsgrad`, `foreach`,
`fused`, `capturable`, `differentiable`) are the engine's to honour or refuse, at `fit()` and
when changed mid-run (superoffload/kernels/hyper.py: `AdamW(maximize=True)` trains as
AdamW does, `AdamW(amsgrad=True)` is refused naming the way). What it takes over:
* `backward` -> `engine.backward` (Lightning's `on_before_backward` / `on_after_backward`
  hooks still run); `optimizer_step` runs the closure, the `on_before_optimizer_step` hooks,
  `configure_gradient_clipping` and `engine.step()`. Lightning never clips `p.grad`:
  `gradient_clip_val` (norm) is the engine's `max_grad_norm`, `accumulate_grad_batches` its
  `grad_accum_steps`, and the precision plugin's `clip_grad_by_norm` (what the default
  `configure_gradient_clipping`, an override of it and `self.clip_gradients` call) is
  `engine.clip_grad_norm_`. In `on_before_optimizer_step` hooks `p.grad` holds every
  gradient, as without the strategy (`bridge.gradients_in_grad`), so Lightning's recipe
  `self.log_dict(grad_norm(self, norm_type=2))` logs the whole model's norms. Editing `p.grad`
  in a hook (a manual `clip_grad_norm_`) raises: the buckets have left; use
  `self.clip_gradients` or `configure_gradient_clipping`.
* Precision: "32-true", "bf16-mixed" (autocast over fp32 weights), "bf16-true" and "16-true"
  (16-bit weights, fp32 masters in the engine; fp16 with the engine's dynamic loss scale).
  "16-mixed" is refused: its GradScaler scales `p.grad`, which the engine replaces.
* Checkpoints: the optimizer state is `engine.state_dict()` plus the module optimizer's
  groups and the torch RNG state; the model's state dict is read after `synchronize()`.
  Resuming with `fit(ckpt_path=...)` at an epoch boundary continues bit-identically
  (mid-epoch, Lightning restarts the epoch's data loader, engine or not).
* The engine's metrics (`superoffload/tokens_per_s`, `d2h_gbps_busy`, `cpu_step_hidden_pct`...)
  go to every logger (`logger.log_metrics`) each `log_every_n_steps` optimizer steps.
* Validation forwards are kept out of the engine's timeline. The engine lives for one
  `fit()`: `teardown` closes it (the module keeps its trained weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "superoffload.integrations.lightning needs Lightning: pip install 'superoffload[lightning]'"
    ) from exc

from superoffload.config import ConfigError, OffloadConfig
from superoffload.integrations.bridge import (
    EngineMetrics,
    backward,
    engine_config,
    gradients_in_grad,
)
from superoffload.integrations.offloaded_optimizer import (
    copy_hyper,
    engine_groups,
    step_without_gradients,
)

PRECISIONS = frozenset({"32-true", "32", "bf16-true", "16-true", "bf16-mixed"})


class SuperOffloadStrategy(SingleDeviceStrategy):
    """Single-device Lightning strategy whose optimizer is the offload engine.

    `config`: an OffloadConfig or a DeepSpeed-style dict (default `OffloadConfig()`); its
    clipping and accumulation come from the Trainer (a contradiction is a ConfigError).
    `device`: default CUDA when available, else the CPU. `engine_kwargs` go to
    `so.initialize`. The engine is `strategy.engine` while `fit()` runs."""

    strategy_name = "superoffload"

    def __init__(self, config: OffloadConfig | Mapping[str, Any] | None = None, *,
                 device: str | torch.device | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)
        self.offload_config = config
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: Any = None
        self.engine_metrics: EngineMetrics | None = None
        self._engine_groups: list[tuple[int, int]] = []
        """(engine group, module optimizer group) index pairs."""
        self._steps = 0
        self._quiet: bool | None = None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup (precision conversion, device, optimizers), then the engine."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in PRECISIONS:
            raise ConfigError(
                f"Trainer(precision={precision!r}) with SuperOffloadStrategy: use one of "
                f"{sorted(PRECISIONS)}; for fp16 use '16-true' (fp16 weights, the engine's "
                "dynamic loss scale): '16-mixed' scales p.grad with a GradScaler, which the "
                "engine replaces")
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer)

    def _build_engine(self, trainer: pl.Trainer) -> None:
        import superoffload as so

        if len(self.optimizers) != 1:
            raise ConfigError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; "
                "SuperOffloadStrategy drives one (torch.optim.AdamW or Adam)")
        opt = self.optimizers[0]
        if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
            raise ConfigError(
                f"configure_optimizers returned {type(opt).__name__}; the offload engine runs "
                "Adam/AdamW: return torch.optim.AdamW (or Adam) with your hyperparameters")
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm")
        if trainer.gradient_clip_val and algorithm != "norm":
            raise ConfigError(
                f"Trainer(gradient_clip_algorithm={algorithm!r}): the engine clips by global "
                "norm only; use gradient_clip_algorithm='norm'")
        config = engine_config(
            self.offload_config, max_grad_norm=trainer.gradient_clip_val,
            grad_accum_steps=trainer.accumulate_grad_batches,
            names=("Trainer(gradient_clip_val)", "Trainer(accumulate_grad_batches)"))
        if config.device == "auto":
            config = config.replace(device=str(self.root_device))
        groups, self._engine_groups = engine_groups(opt)
        self.engine = so.initialize(self.lightning_module, groups, config, **self.engine_kwargs)
        # Lightning's clipping (the default configure_gradient_clipping, a user's override,
        # self.clip_gradients in manual optimization) ends in the precision plugin's
        # clip_grad_by_norm: route it to the engine, which clips every bucket under STV
        self.precision_plugin.clip_grad_by_norm = self._clip_by_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = self._clip_by_value  # type: ignore[method-assign]
        self.engine_metrics = EngineMetrics(self.engine)
        self._steps = 0

    def _sync_hyper(self) -> None:
        """The module optimizer's hyperparameters (a scheduler changed them) -> the engine's."""
        copy_hyper(self.optimizers[0].param_groups, self.engine.optimizer.param_groups,
                   self._engine_groups)

    def _engine_or_raise(self) -> Any:
        if self.engine is None:
            raise RuntimeError("SuperOffloadStrategy: the engine is built in fit(); "
                               "backward/step outside fit are not supported")
        return self.engine

    # ------------------------------------------------------------------ training
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """`engine.backward` with Lightning's backward hooks around it."""
        engine, module = self._engine_or_raise(), self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._sync_hyper()
        backward(engine, closure_loss)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Closure (training_step + backward), `on_before_optimizer_step`, `engine.step()`."""
        engine = self._engine_or_raise()
        loss = closure()
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        # a hook that reads gradients (Lightning's recipe: grad_norm(self, norm_type=2)) sees
        # them all in p.grad, as without the strategy; only when one is overridden: showing
        # them costs the offloaded gradients' bytes on the device while the hooks run
        shown = gradients_in_grad(engine) if _reads_gradients(trainer) else nullcontext()
        with shown:
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self._sync_hyper()
        # Lightning's order: hooks, then clip
        if self.lightning_module.automatic_optimization:
            call._call_lightning_module_hook(
                trainer, "configure_gradient_clipping", optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        engine.step()
        # the engine stepped on the module optimizer's behalf: tell its LR scheduler
        step_without_gradients(getattr(optimizer, "optimizer", optimizer))
        self._steps += 1
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))
        if self.engine_metrics is not None and self._steps % every == 0 and trainer.loggers:
            metrics = self.engine_metrics.collect()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        return loss

    def _clip_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._engine_or_raise().clip_grad_norm_(float(clip_val))

    def _clip_by_value(self, optimizer: Any, clip_val: float) -> None:
        raise ConfigError(
            "clipping by value (gradient_clip_algorithm='value' or clip_gradients(..., "
            "gradient_clip_algorithm='value')): the engine clips by the global norm only, inside "
            "its step; use gradient_clip_algorithm='norm'")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.engine_metrics is not None:
            self.engine_metrics.add_tokens(_tokens(batch))
        super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------ evaluation
    def on_validation_start(self) -> None:
        # keep evaluation forwards out of the engine's timeline
        if self.engine is not None:
            self.engine.synchronize()
            self._quiet, self.engine.telemetry.enabled = self.engine.telemetry.enabled, False
        super().on_validation_start()

    def on_validation_end(self) -> None:
        if self.engine is not None and self._quiet is not None:
            self.engine.telemetry.enabled, self._quiet = self._quiet, None
        super().on_validation_end()

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        self.engine.synchronize()
        with self.engine.resident_weights():
            return {k: v.detach().clone() for k, v in super().lightning_module_state_dict().items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        # LightningOptimizer -> torch's
        inner = getattr(optimizer, "_optimizer", optimizer)
        return {"superoffload_engine": self.engine.state_dict(),
                "module_optimizer": inner.state_dict(),
                "torch_rng": torch.get_rng_state()}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self.engine is None or not states or "superoffload_engine" not in states[0]:
            raise ConfigError(
                "checkpoint: no superoffload engine state in 'optimizer_states'; it was not "
                "written by SuperOffloadStrategy (load weights only, e.g. "
                "LightningModule.load_from_checkpoint, and start a new run)")
        state = states[0]
        self.optimizers[0].load_state_dict(state["module_optimizer"])
        self.engine.load_state_dict(state["superoffload_engine"])
        torch.set_rng_state(state["torch_rng"])

    def teardown(self) -> None:
        """Close the engine (the module keeps its trained weights), then Lightning's teardown."""
        if self.engine is not None:
            self.engine.close()
            self.engine = self.engine_metrics = None
        super().teardown()


def _reads_gradients(trainer: Any) -> bool:
    """Whether the module or a callback overrides `on_before_optimizer_step` (Lightning's
    own implementations are empty: no built-in callback reads gradients there)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    hook = "on_before_optimizer_step"
    return is_overridden(hook, trainer.lightning_module, pl.LightningModule) or any(
        is_overridden(hook, cb, pl.Callback) for cb in trainer.callbacks)


def _tokens(batch: Any) -> int:
    """Tokens in a batch: `input_ids` of a dict, else the first tensor's elements."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
        batch = list(batch.values())
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].numel()
    return 0


__all__ = ["PRECISIONS", "SuperOffloadStrategy"]
