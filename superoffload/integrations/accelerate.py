"""Hugging Face Accelerate with the offload engine: an `Accelerator` (docs/integrations.md).

    from superoffload.integrations.accelerate import SuperOffloadAccelerator
    accelerator = SuperOffloadAccelerator(gradient_accumulation_steps=2,
                                          offload_config=so.presets.gh200())   # the one change
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:                      # the loop of any Accelerate script, unchanged
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")            # ... accelerator.load_state("ckpt") resumes exactly

Like the Lightning strategy, and like accelerate's own DeepSpeed path
(the Accelerator sends `backward` to DeepSpeed's engine
and lets it clip), the
accelerator takes over what the engine must own and leaves the script alone:

* `prepare(optimizer)` accepts the optimizer an Accelerate script builds
  (`torch.optim.AdamW` / `Adam`: the engine is built from its groups and hyper-parameters,
  which stay what schedulers see and are copied into the engine before every backward and
  step), or an engine's own `engine.optimizer`, or the Trainer integration's
  `OffloadedOptimizer`. It returns an `OffloadedOptimizer` (integrations/offloaded_optimizer.py,
  the Trainer's too), which steps and zeroes only when `accelerator.sync_gradients` (as
  accelerate's `AcceleratedOptimizer` does) and never round-trips the engine's state
  (accelerate's wrapper copies an optimizer's whole state at prepare). An LR scheduler built
  on the object you passed is prepared as usual.
* `backward(loss)` -> `engine.backward(loss / gradient_accumulation_steps)`: the loss plain
  Accelerate backpropagates, with the buckets leaving for the CPU during backward.
* `clip_grad_norm_(model.parameters(), max_norm)` -> `engine.clip_grad_norm_`: returns the
  total norm as torch does; the engine clips every bucket inside its step (paper §4.3).
* `save_state` / `load_state`: the optimizer's state is `engine.state_dict()` (fp32 masters,
  moments, step counts, loss scaler, STV state) plus the torch optimizer's groups (the lr a
  scheduler set); accelerate saves the weights, scheduler, RNG and data positions as always.
* Refused, naming the way: several processes (use torchrun with the engine's data-parallel
  path, docs/distributed.md), `mixed_precision="fp16"` (its GradScaler scales `p.grad`,
  which the engine replaces: use "bf16", or fp16 weights and the engine's loss scale), a
  step asked for before `gradient_accumulation_steps` backwards other than at the end of the
  data loader (a loop without `accumulate()`), clipping by value or over part of the model.
* A data loader whose length is not a multiple of the accumulation steps: accelerate ends the
  last window early and steps on its partial sums, and so does the engine (accumulation.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "superoffload.integrations.accelerate needs accelerate: pip install 'superoffload[hf]'"
    ) from exc

from superoffload.config import ConfigError, OffloadConfig
from superoffload.integrations.bridge import EngineMetrics, engine_config
from superoffload.integrations.offloaded_optimizer import OffloadedOptimizer, engine_behind


class SuperOffloadAccelerator(Accelerator):
    """`accelerate.Accelerator` whose optimizer is the offload engine (module docstring).

    `offload_config`: an OffloadConfig or a DeepSpeed-style dict (default `OffloadConfig()`)
    for the engine built from a torch optimizer; its `grad_accum_steps` comes from
    `gradient_accumulation_steps` (a contradiction is a ConfigError). `engine_kwargs` go to
    `so.initialize`. Every other argument is `Accelerator`'s. The engine is
    `accelerator.engine` once prepared; `accelerator.engine_metrics.collect()` gives its
    metrics for `accelerator.log`."""

    def __init__(self, *args: Any,
                 offload_config: (OffloadConfig | Mapping[str, Any] | str | os.PathLike[str]
                                  | None) = None,
                 engine_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.distributed_type != DistributedType.NO:
            raise ConfigError(
                f"SuperOffloadAccelerator runs one process, this launch is {self.distributed_type}"
                " with several: launch it with plain `python`, or train data-parallel with "
                "torchrun and the engine's own data-parallel path (docs/distributed.md)")
        if self.mixed_precision == "fp16":
            raise ConfigError(
                "Accelerator(mixed_precision='fp16') with SuperOffloadAccelerator: its "
                "GradScaler scales p.grad, which the engine replaces; use mixed_precision="
                "'bf16' or 'no' (fp16 weights, model.half(), train with the engine's own "
                "dynamic loss scale)")
        self.offload_config = offload_config
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine_metrics: EngineMetrics | None = None

    @property
    def offload_optimizers(self) -> list[OffloadedOptimizer]:
        return [o for o in self._optimizers if isinstance(o, OffloadedOptimizer)]

    @property
    def engine(self) -> Any:
        """The engine (None before `prepare` saw its model)."""
        bound = [o.engine for o in self.offload_optimizers if o.engine is not None]
        return bound[0] if bound else None

    def engine_config(self) -> OffloadConfig:
        """`offload_config` with this accelerator's accumulation steps and device."""
        config = engine_config(
            self.offload_config, max_grad_norm=None,
            grad_accum_steps=self.gradient_accumulation_steps,
            names=("accelerator.clip_grad_norm_(max_norm)",
                   "Accelerator(gradient_accumulation_steps)"))
        return config.replace(device=self.device.type) if config.device == "auto" else config

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """`Accelerator.prepare`; then each torch optimizer becomes an engine on its model."""
        result = super().prepare(*args, device_placement=device_placement)
        for opt in self.offload_optimizers:
            if opt.engine is None:
                opt.bind(self._models)
        engines = {id(e): e for e in (o.engine for o in self.offload_optimizers) if e is not None}
        if len(engines) > 1:
            raise ConfigError(f"SuperOffloadAccelerator drives one engine (one model and its "
                              f"optimizer); {len(engines)} were prepared")
        if engines and self.engine_metrics is None:
            self.engine_metrics = EngineMetrics(next(iter(engines.values())))
        return result

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Any = None) -> OffloadedOptimizer:
        # ours, or the Trainer's: adopted as it is
        if isinstance(optimizer, OffloadedOptimizer):
            if optimizer.accelerator is None:
                self._check_engine(optimizer.bound())
                optimizer.accelerator = self
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        engine = engine_behind(optimizer)
        if engine is None and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ConfigError(
                f"accelerator.prepare({type(optimizer).__name__}): the offload engine runs "
                "Adam/AdamW; pass torch.optim.AdamW (or Adam) with your hyper-parameters, or "
                "an engine's engine.optimizer")
        if engine is not None:
            self._check_engine(engine)
        wrapped = OffloadedOptimizer(engine, optimizer, accelerator=self)
        self._optimizers.append(wrapped)
        return wrapped

    def _check_engine(self, engine: Any) -> None:
        gas = self.gradient_accumulation_steps
        if engine.config.grad_accum_steps != gas:
            raise ConfigError(
                f"the engine's OffloadConfig.grad_accum_steps={engine.config.grad_accum_steps} "
                f"contradicts Accelerator(gradient_accumulation_steps={gas}): build the engine "
                f"with OffloadConfig(grad_accum_steps={gas}), or prepare a torch AdamW and let "
                "the accelerator build the engine")

    # ------------------------------------------------------------------ training
    def _offload_for(self) -> OffloadedOptimizer | None:
        for opt in self.offload_optimizers:
            if opt.engine is not None:
                return opt
        return None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`engine.backward` of the loss plain Accelerate backpropagates (divided by the
        accumulation steps)."""
        opt = self._offload_for()
        if opt is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise ConfigError(f"accelerator.backward(loss, {', '.join(kwargs)}=...): the engine "
                              "runs the backward pass itself and takes no options")
        self._check_engine(opt.bound())
        # the engine launches CPU steps during backward: the lr of this step
        opt.sync_hyper()
        gas = self.gradient_accumulation_steps
        opt.bound().backward(loss / gas if gas != 1 else loss, scale_wrt_gas=False)
        opt.count_backward()
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """`engine.clip_grad_norm_` when `parameters` are the engine's: the total norm, and
        every bucket clipped inside the step."""
        opt = self._offload_for()
        if opt is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        params = list(parameters)
        engine = opt.bound()
        ours = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        given = {id(p) for p in params if p.requires_grad}
        if not given & ours:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        if given != ours:
            raise ConfigError(
                f"accelerator.clip_grad_norm_ over {len(given & ours)} of the engine's "
                f"{len(ours)} parameters: the engine clips by the global norm of all of them "
                "(what its speculation validates); pass model.parameters()")
        if self.sync_gradients:
            opt.close_window("accelerator.clip_grad_norm_")
        return engine.clip_grad_norm_(float(max_norm), norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        if self._offload_for() is None:
            return super().clip_grad_value_(parameters, clip_value)
        raise ConfigError(
            "accelerator.clip_grad_value_: the engine clips by the global norm only, inside its "
            "step; use accelerator.clip_grad_norm_(model.parameters(), max_norm)")

    def free_memory(self, *objects: Any) -> Any:
        """Close the engines this accelerator built (the model keeps its trained weights),
        then `Accelerator.free_memory`."""
        for opt in self.offload_optimizers:
            if opt.built and opt.engine is not None:
                opt.engine.close()
        self.engine_metrics = None
        return super().free_memory(*objects)


__all__ = ["SuperOffloadAccelerator"]
