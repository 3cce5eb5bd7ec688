"""The engine's optimizer: a ``torch.optim.Optimizer`` that *is* the step, the gradients' reads,
the state dicts and the param groups (docs/conventions.md, "PyTorch's optimizer contract").

NOTE: the state (fp32 masters, moments) lives in the engine's bucket buffers -- host memory,
the storage tier, the GPU tail -- not in ``self.state``; ``param_groups`` are torch's, read
when each iteration freezes its settings (runtime/frozen.py), so an LR scheduler's change
applies from the next step. ``step`` is torch's step, wrapped by torch like any optimizer's:
step hooks run around it, an LR scheduler's wrapper of ``optimizer.step`` sees it, whichever
of ``engine.step()`` and ``engine.optimizer.step()`` a loop calls -- the engine's names are
this object's methods (``ToOptimizer``), so there is one implementation, here. Schedulers,
hooks, Accelerate, Lightning and Trainer meet this one object.

What a step does (paper §4.3; runtime/stv.py): validate the iteration's gradients over every
bucket and rank, decide (commit, clip, skip), settle every bucket, close the iteration. This
module holds the order and the contract around it; the engine (runtime/engine.py) holds the
parts, the lanes and the iteration's boundary, which it calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from superoffload.config import OffloadConfig
from superoffload.kernels.hyper import DEFAULTS
from superoffload.runtime import contract, engine_checkpoint, stv
from superoffload.runtime.boundary import Boundary
from superoffload.runtime.engine_state import EngineState, ParamState, initial_state
from superoffload.runtime.iteration import Parts
from superoffload.runtime.launch import Launcher, check_plain_passes, passes
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import (
    is_torch_state_dict,
    load_torch_state,
    new_group,
    new_params,
)
from superoffload.runtime.transport import Transport
from superoffload.telemetry.recorder import Recorder


class Engine(Protocol):
    """What the optimizer reads and calls of its engine (runtime/engine.py): the iteration
    core's parts and the boundary of an iteration."""

    config: OffloadConfig
    state: EngineState
    launcher: Launcher
    parts: Parts
    scaler: LossScaler
    adaptive: stv.AdaptiveSTV
    telemetry: Recorder
    transport: Transport
    contract: contract.Contract
    weights: Any
    iteration: int
    control: Boundary

    def raise_if_failed(self) -> None: ...

    def synchronize(self) -> None: ...

    def settled(self, what: str) -> None: ...

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]: ...

    def build_from(self, states: Mapping[int, ParamState]) -> None: ...

    def reinstall_hooks(self) -> None: ...



class OffloadOptimizer(torch.optim.Optimizer):
    """See the module docstring; built by the engine (``so.initialize``)."""

    def __init__(self, engine: Engine, groups: Iterable[dict[str, Any]],
                 defaults: Mapping[str, Any] | None = None) -> None:
        # torch's __init__ adds the groups it is given
        self.engine: Engine | None = None
        super().__init__(list(groups), dict(defaults or DEFAULTS))
        self.engine = engine
        self.last_grad_norm: float | None = None
        """The last step's global gradient norm (``grad_norm()`` after ``step()``)."""
        self._last_step_end = time.perf_counter()

    def _engine(self) -> Engine:
        engine = self.engine
        assert engine is not None, "the engine builds its optimizer"
        return engine

    # ------------------------------------------------------------------ the step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The optimizer step at the end of gradient accumulation (a no-op before it, as
        DeepSpeed's: a loop may call it every micro-step): validate, decide, settle, close.
        ``closure`` (torch's): re-evaluates the loss first and returns it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine()
        engine.raise_if_failed()
        launcher = engine.launcher
        if 0 < passes(launcher.current) < engine.config.grad_accum_steps:
            # DeepSpeed semantics: step() every micro-step, acts on the boundary
            return loss
        try:
            engine.control.end_backward()
            # a plain loss.backward(): no overlap, no STV
            if launcher.current.micro_step == 0:
                check_plain_passes(launcher.current, engine.config, "step()")
                engine.control.arm_without_backward()
            it, parts = launcher.current, engine.parts
            if it.validated is None:
                glob = stv.validate(it, parts)
            else:
                # clip_grad_norm_ validated already: only the edits made since are checked
                glob = stv.check_again(it, parts, it.validated)
            v = stv.decide(it, parts, glob)
            # from here an interruption leaves the iteration half-settled
            it.settling = True
            stv.settle(it, v, glob, parts)
            stv.close_iteration(it, v, glob, parts, scaler=engine.scaler,
                                adaptive=engine.adaptive)
            self.last_grad_norm = v.grad_norm
        except contract.ContractError:  # the same on every rank: roll the iteration back
            engine.control.abort()
            engine.synchronize()
            raise
        except BaseException as exc:
            engine.control.interrupted(exc, "step()")
            raise
        self._close_telemetry(engine, it.frozen.number)
        launcher.next_iteration()
        engine.raise_if_failed()
        return loss

    def _close_telemetry(self, engine: Engine, n: int) -> None:
        """The iteration's scalars of the weight policy and its wall time."""
        weights, rec = engine.weights, engine.telemetry
        flow = weights.flow
        rec.scalar("weights_flow", n, 1.0 if weights.active == "flow" else 0.0)
        rec.scalar("device_weight_bytes", n, float(weights.fixed_weight_bytes + (
            flow.iteration_peak_bytes if flow is not None else 0)))
        if flow is not None:
            flow.iteration_peak_bytes = flow.held_bytes
        now = time.perf_counter()
        rec.scalar("iteration_s", n, now - self._last_step_end)
        self._last_step_end = now

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: drop the gradients; between the last backward and ``step()`` the
        iteration is discarded, mid-accumulation nothing."""
        engine = self._engine()
        it = engine.launcher.current
        if 0 < passes(it) < engine.config.grad_accum_steps:
            # mid-accumulation: keep the partial sums
            return
        # after backward, before step(): discard the iteration, as torch drops the gradients
        # and its step then does nothing
        if it.micro_step:
            engine.raise_if_failed()
            engine.control.abort()
            engine.synchronize()
        # the user's own backward passes are discarded with their sums
        it.plain.clear()
        st = engine.state
        for i in st.trainable:
            p = st.params[i]
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    # ------------------------------------------------------------------ the gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the engine's gradients: call it between the
        last ``backward()`` and ``step()`` (on every rank under data parallel: it reduces).
        Returns the total 2-norm of the unscaled gradient over every bucket and rank, as torch
        does (inf/nan when one is non-finite); ``step()`` then clips every bucket by
        ``max_norm`` (with ``OffloadConfig.max_grad_norm`` too: the smaller wins) under STV.
        ``foreach`` is accepted for signature compatibility (the engine has its own kernels)."""
        engine = self._engine()
        engine.raise_if_failed()
        threshold = stv.check_clip_args(max_norm, norm_type)
        self._gradients_final("clip_grad_norm_()")
        return stv.clip_grad_norm(engine.launcher.current, engine.parts, threshold,
                                  error_if_nonfinite)

    def grad_norm(self) -> float:
        """The global 2-norm of this iteration's unscaled gradient, over every bucket and
        rank: what ``step()`` clips by and ``clip_grad_norm_`` returns (inf/nan when one is
        non-finite), without clipping. Read-only; between the last micro-step's
        ``backward()`` and ``step()`` (on every rank under data parallel: it reduces), or
        after ``step()``: the norm that step validated."""
        engine = self._engine()
        engine.raise_if_failed()
        it = engine.launcher.current
        if passes(it) == 0 and it.validated is None:
            if self.last_grad_norm is None:
                raise contract.ContractError("grad_norm() before any backward(): there is no "
                                             "gradient yet; call it after backward()")
            return self.last_grad_norm
        self._gradients_final("grad_norm()")
        return stv.validate_early(engine.launcher.current, engine.parts, None)[0]

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient as a plain torch loop holds it in ``.grad`` (unscaled, summed
        over the micro-steps, averaged over data-parallel ranks), in fp32: a copy from its
        host buffer for an offloaded parameter (whose ``.grad`` left the device with its
        bucket), from the device for a GPU tail one; None when it got no gradient. Between
        the last micro-step's ``backward()`` and ``step()`` (DeepSpeed's
        ``safe_get_full_grad``). Read-only: change gradients with
        ``register_grad_transform``."""
        engine = self._engine()
        engine.raise_if_failed()
        st = engine.state
        i = st.index.get(id(param))
        if i is None or i not in st.bucket_of:
            raise ValueError("full_grad: the tensor is not a trainable parameter of the "
                             "engine's model (pass one of model.parameters())")
        self._gradients_final("full_grad()")
        return stv.full_grad(engine.launcher.current, engine.parts, i)

    def _gradients_final(self, what: str) -> None:
        """``what`` reads this iteration's final gradients: after the last micro-step's
        backward, before ``step()``; a plain ``loss.backward()`` loop's buckets launch now."""
        engine = self._engine()
        it, gas = engine.launcher.current, engine.config.grad_accum_steps
        done = passes(it)
        if done == 0:
            raise contract.ContractError(f"{what} before any backward() since the last step(): "
                                         "there is no gradient yet; call it after backward()")
        if done < gas:
            raise contract.ContractError(
                f"{what} after backward() {done} of {gas} (OffloadConfig.grad_accum_steps): "
                "the gradients are still accumulating; call it after the last micro-step's "
                "backward(), just before step()")
        # a plain loss.backward() loop: the buckets launch now
        if it.micro_step == 0:
            check_plain_passes(it, engine.config, what)
            engine.control.arm_without_backward()

    # ------------------------------------------------------------------ state, groups
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The engine's state dict (runtime/engine_checkpoint.py): masters, moments, step counts,
        param groups, loss scaler, counters; between iterations."""
        engine = self._engine()
        engine.settled("state_dict()")
        return engine_checkpoint.engine_state_dict(engine)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """An engine state dict, or a ``torch.optim`` AdamW/Adam state dict (migrating a run:
        ``runtime/optim_view.py`` ``load_torch_state``)."""
        engine = self._engine()
        engine.settled("load_state_dict()")
        if is_torch_state_dict(state_dict):
            load_torch_state(engine, state_dict)
            return
        engine_checkpoint.load_engine_state_dict(engine, state_dict)  # type: ignore[arg-type]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``: the group's parameters get buckets (a
        re-plan from the current state) and step from the next iteration with fresh
        moments, as torch's do."""
        engine = self.engine
        # torch's __init__: the groups the engine is built with
        if engine is None:
            super().add_param_group(param_group)
            return
        engine.settled("optimizer.add_param_group()")
        if engine.weights.active == "flow":
            raise contract.ContractError(
                "optimizer.add_param_group() under weights='flow' is not supported (the streamed "
                "blocks are planned from the parameters present at initialize): list every "
                "group at so.initialize (a group may start with lr=0), or use "
                "weights='stationary'")
        group, st = new_group(param_group, self.defaults), engine.state
        new = new_params(group, st)
        engine.synchronize()
        states = engine.export_states()
        contract.claim_params([st.params[i] for i in new], engine, [st.names[i] for i in new])
        super().add_param_group(group)
        g = len(self.param_groups) - 1
        for i in new:
            st.group_of[i] = g
            states[i] = initial_state(st.params[i])
        st.trainable = sorted(set(st.trainable) | set(new))
        # every data-parallel rank must add the same group (the re-plan below is collective)
        engine.transport.agree(contract.fingerprint(st, engine.config, engine.control.hypers()))
        engine.build_from(states)
        engine.reinstall_hooks()
        engine.contract.rebase(new)
        engine.telemetry.note(engine.iteration, f"param group {g} added: {len(new)} "
                                                "parameter(s) get buckets and train from the "
                                                "next step")


class ToOptimizer:
    """An engine attribute that is its optimizer's method: ``engine.step`` *is*
    ``engine.optimizer.step`` (an LR scheduler's wrapper of it included), one implementation
    whichever a loop calls (runtime/engine.py)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.optimizer, self.name)
