"""The offload engine as the `torch.optim.Optimizer` a framework calls, and a framework's own
torch optimizer mapped onto it: one home for Hugging Face `Trainer` (integrations/hf.py),
Accelerate (integrations/accelerate.py) and Lightning (integrations/lightning.py).

* `OffloadedOptimizer` is what `SuperOffloadTrainer.create_optimizer` and
  `SuperOffloadAccelerator.prepare` return: the engine's step behind accelerate's optimizer
  contract (one class for both, so a Trainer's optimizer prepared by the accelerator is the
  same object).
* `engine_groups` / `copy_hyper`: when an integration builds the engine from the torch
  optimizer a script made (`torch.optim.AdamW` in an Accelerate script, Lightning's
  `configure_optimizers`), the engine's groups come from its groups, and the
  hyper-parameters an LR scheduler sets on it are copied over before the engine reads them.
* `step_without_gradients`: that torch optimizer's own step, with nothing to apply, after the
  engine stepped on its behalf: torch's LR scheduler wraps `optimizer.step` to notice that a
  step ran (and warns that `lr_scheduler.step()` ran first otherwise), and step hooks
  registered on it run, as they would without the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from superoffload.config import ConfigError
from superoffload.integrations.accumulation import complete_window
from superoffload.integrations.bridge import adam_hyper
from superoffload.kernels.hyper import HYPER_KEYS, torch_flag_keys, torch_flags


def sync_gradients() -> bool:
    """accelerate's `sync_gradients`: True when no accumulation window is open (and when no
    Accelerator is in use: nothing accumulates)."""
    from accelerate.state import GradientState

    return bool(GradientState().sync_gradients)


def engine_groups(optimizer: torch.optim.Optimizer
                  ) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """(the engine's param groups, (engine group, torch group) index pairs) for a torch
    Adam/AdamW: each group's trainable parameters with its hyper-parameters and AdamW flags
    (honoured or refused by the engine, kernels/hyper.py); a group with none is left out."""
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay"))
    groups: list[dict[str, Any]] = []
    pairs: list[tuple[int, int]] = []
    for k, group in enumerate(optimizer.param_groups):
        trained = [p for p in group["params"] if p.requires_grad]
        if trained:
            groups.append({"params": trained, **adam_hyper(group, adamw=adamw),
                           **torch_flags(group)})
            pairs.append((len(groups) - 1, k))
    return groups, pairs


def copy_hyper(theirs: list[dict[str, Any]], ours: list[dict[str, Any]],
               pairs: Iterable[tuple[int, int]]) -> None:
    """The torch optimizer's hyper-parameters (``HYPER_KEYS``) and AdamW flags (an LR
    scheduler set them) -> the engine's groups. Index pairs, not the dicts:
    `Optimizer.load_state_dict` replaces the group dicts. A flag set mid-run is honoured or
    refused at the engine's next step."""
    flags = torch_flag_keys()
    for k_ours, k_theirs in pairs:
        for key in (*HYPER_KEYS, *(k for k in theirs[k_theirs] if k in flags)):
            value = theirs[k_theirs][key]
            ours[k_ours][key] = tuple(value) if key == "betas" else value


def step_without_gradients(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()` with every parameter's gradient hidden, so it changes nothing (a
    torch optimizer skips a parameter whose `grad` is None), then the gradients put back:
    the engine stepped on its behalf (module docstring)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g


class OffloadedOptimizer(torch.optim.Optimizer):
    """The engine as the `torch.optim.Optimizer` Trainer and accelerate call.

    NOTE: like accelerate's `AcceleratedOptimizer` it does not call `Optimizer.__init__` and
    holds no state of its own: its `param_groups` are the ones LR schedulers change, those of
    `optimizer` (the torch optimizer passed in), or the engine's own when none was. It is
    marked prepared, so accelerate neither wraps it again nor round-trips its state (a full
    copy); `optimizer` is what accelerate's wrapper calls the optimizer it wraps
    (`prepare_scheduler` matches schedulers by it; it used to raise AttributeError for
    Trainer's). `step` / `zero_grad` act only when accelerate's `sync_gradients` says the
    accumulation window is complete (it used to step on every micro-batch of
    `accelerator.accumulate`); Trainer sets that flag for every micro-step.
    `step_was_skipped` tells accelerate (`Accelerator.optimizer_step_was_skipped`) that an
    fp16 overflow skipped the step, so the LR scheduler is left alone, as with DeepSpeed."""

    # accelerate: prepared, do not wrap or copy it
    _is_accelerate_prepared = True

    def __init__(self, engine: Any = None, optimizer: torch.optim.Optimizer | None = None,
                 accelerator: Any = None) -> None:
        self.engine = engine
        """The engine: given, or built from `optimizer` at `bind` (the accelerator's)."""
        self.optimizer: torch.optim.Optimizer = self if optimizer is None else optimizer
        """The object passed in (`engine.optimizer`, a torch Adam/AdamW), or itself."""
        self.accelerator = accelerator
        """The `SuperOffloadAccelerator` whose accumulation window `step` checks (None under
        Trainer, whose loop keeps the window)."""
        self.built = False
        """Whether `bind` built the engine (the accelerator then closes it in `free_memory`)."""
        self._pairs: list[tuple[int, int]] = []
        """(engine group, torch group) indices whose hyper-parameters are copied over."""
        self._micro = 0
        self._skipped = False

    # ------------------------------------------------------------------ torch surface
    def _groups_of(self) -> torch.optim.Optimizer:
        return self.bound().optimizer if self.optimizer is self else self.optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._groups_of().param_groups

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._groups_of().defaults

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        return self._groups_of().state

    @property
    def step_was_skipped(self) -> bool:
        """An fp16 overflow skipped the last step (accelerate then keeps the scheduler)."""
        return self._skipped

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not sync_gradients():
            # mid-accumulation: accelerate's optimizer does nothing either
            return loss
        engine = self.bound()
        if self.accelerator is not None:
            self.close_window("optimizer.step()")
        self.sync_hyper()
        before = engine.stats.skipped_steps
        engine.step()
        # the engine stepped on the torch optimizer's behalf: tell its scheduler
        if self.built:
            step_without_gradients(self.optimizer)
        self._micro = 0
        self._skipped = engine.stats.skipped_steps > before
        return loss

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if sync_gradients():
            self.bound().zero_grad(True if set_to_none is None else set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The engine's state; for an engine built from a torch optimizer, also that
        optimizer's groups (the lr a scheduler set)."""
        engine = self.bound()
        if not self.built:
            return engine.state_dict()  # type: ignore[no-any-return]
        return {"superoffload_engine": engine.state_dict(),
                "torch_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        engine = self.bound()
        if self.built:
            if "superoffload_engine" not in state_dict:
                raise ConfigError(
                    "load_state: the optimizer state holds no superoffload engine state; it was "
                    "not saved by SuperOffloadAccelerator (load the model's weights only and "
                    "start the optimizer afresh)")
            self.optimizer.load_state_dict(state_dict["torch_optimizer"])
            state_dict = state_dict["superoffload_engine"]
        engine.load_state_dict(state_dict)
        self._micro = 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.built:
            raise NotImplementedError(
                "add_param_group on a torch optimizer the accelerator turned into an engine: "
                "pass every group before prepare(), or build the engine yourself "
                "(so.initialize) and prepare engine.optimizer, whose add_param_group works")
        if self.optimizer is self:
            raise NotImplementedError(
                "OffloadedOptimizer.add_param_group: Trainer builds the engine once; pass "
                "every parameter group when it is built, or call "
                "trainer.engine.optimizer.add_param_group")
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:
        """Accelerate calls this for schedule-free optimizers; AdamW has no modes."""

    def eval(self) -> None:
        """See `train`."""

    def __repr__(self) -> str:
        inner = "" if self.optimizer is self else f"{type(self.optimizer).__name__}, "
        return f"OffloadedOptimizer({inner}{self.engine!r})"

    # ------------------------------------------------------------------ engine
    def bound(self) -> Any:
        if self.engine is None:
            raise RuntimeError(
                "SuperOffloadAccelerator: no engine yet for this optimizer: pass its model to "
                "accelerator.prepare() too (the engine is built on the model)")
        return self.engine

    def bind(self, models: Iterable[torch.nn.Module]) -> bool:
        """Build the engine on the model holding the torch optimizer's parameters, once the
        accelerator has prepared it; False while it has not."""
        ids = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        model = next((m for m in models if ids <= {id(p) for p in m.parameters()}), None)
        if model is None:
            return False
        import superoffload as so

        acc = self.accelerator
        groups, self._pairs = engine_groups(self.optimizer)
        self.engine = so.initialize(acc.unwrap_model(model), groups, acc.engine_config(),
                                    **acc.engine_kwargs)
        self.built = True
        return True

    def sync_hyper(self) -> None:
        """`copy_hyper` before each backward and step (the engine reads the groups then)."""
        # else the groups are the engine's own
        if self.built:
            copy_hyper(self.optimizer.param_groups, self.bound().optimizer.param_groups,
                       self._pairs)

    def count_backward(self) -> None:
        self._micro += 1

    def close_window(self, where: str) -> None:
        """`where` reads the window's gradients: an early end completed or refused."""
        complete_window(self.bound(), self._micro, self.accelerator, where)
        self._micro = self.accelerator.gradient_accumulation_steps


def engine_behind(optimizer: Any) -> Any | None:
    """The engine behind `engine.optimizer` or an `OffloadedOptimizer`; None for a torch
    optimizer (an integration builds one from it)."""
    from superoffload.runtime.contract import owner

    engine = getattr(optimizer, "engine", None)
    # an OffloadedOptimizer
    if engine is not None:
        return engine
    params = [p for g in optimizer.param_groups for p in g["params"]]
    engines = {id(e): e for e in (owner(p) for p in params) if e is not None}
    found = next(iter(engines.values()), None)
    if len(engines) == 1 and found is not None and found.optimizer is optimizer:
        return found
    if engines:
        raise ConfigError(
            f"accelerator.prepare({type(optimizer).__name__}): its parameters belong to a live "
            "offload engine already; prepare that engine's engine.optimizer instead (a second "
            "engine would train the same weights from other moments)")
    return None
