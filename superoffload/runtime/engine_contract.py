"""The engine's torch-optimizer surface: what a training loop may do with it (issue 17).

``OffloadEngine`` (runtime/engine.py) inherits these methods; they are the parts of its API a
user reaches for as they would with a ``torch.optim`` optimizer, each either doing what torch
does or raising at once with the supported way (docs/failure_semantics.md, "What you may do
with the engine"):

* ``state_dict`` / ``load_state_dict`` / ``save_checkpoint`` / ``load_checkpoint``: between
  iterations only (never between the last ``backward()`` and ``step()``);
* ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` for every bucket, under STV;
* ``register_grad_transform``: change gradients before they leave (the supported way);
* ``optimizer.add_param_group``: the new parameters get buckets and train from the next step;
* pickling: refused, naming ``save_checkpoint``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from superoffload.runtime import checkpoint, guard, micro_steps
from superoffload.runtime import hooks as engine_hooks
from superoffload.runtime.optim_view import is_torch_state_dict, load_torch_state, new_group
from superoffload.runtime.scheduler import Iteration
from superoffload.runtime.settle import validate_early
from superoffload.runtime.state import ParamState, initial_state

if TYPE_CHECKING:
    from superoffload.config import OffloadConfig
    from superoffload.runtime.errors import FailureBox
    from superoffload.runtime.loss_scaler import LossScaler
    from superoffload.runtime.optim_view import EngineOptimizer
    from superoffload.runtime.scheduler import EngineStats, IterationScheduler
    from superoffload.runtime.state import EngineState
    from superoffload.runtime.stv import AdaptiveSTV
    from superoffload.runtime.transport import Transport
    from superoffload.runtime.weight_writes import WeightWrites
    from superoffload.runtime.weights import WeightPolicyController
    from superoffload.telemetry.recorder import Recorder


class TorchContract:
    """Mixin of ``OffloadEngine`` (see the module docstring); ``self`` is the engine, whose
    parts these methods use are declared here."""

    config: OffloadConfig
    model: torch.nn.Module
    state: EngineState
    contract: guard.Contract
    transport: Transport
    scheduler: IterationScheduler
    optimizer: EngineOptimizer
    scaler: LossScaler
    adaptive: AdaptiveSTV
    weights: WeightPolicyController
    writes: WeightWrites
    telemetry: Recorder
    hooks: list[Any]
    _core_hooks: list[Any]
    _closed_why: str
    failures: FailureBox

    # the engine's own (runtime/engine.py)
    iteration: int
    closed: bool

    @property
    def stats(self) -> EngineStats:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def raise_if_failed(self) -> None:
        raise NotImplementedError

    def _build(self, states: Mapping[int, ParamState]) -> None:
        raise NotImplementedError

    def _hypers(self) -> list[Any]:
        raise NotImplementedError

    def _arm_without_backward(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def trainable_params(self) -> list[torch.nn.Parameter]:
        """The parameters the engine steps, in parameter-index order."""
        return [self.state.params[i] for i in self.state.trainable]

    # ------------------------------------------------------------------ state, checkpoints
    def export_states(self) -> dict[int, ParamState]:
        """Placement-free copies of every trainable parameter's state (call synchronized)."""
        return self.transport.export_states()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weight of every trainable parameter (CPU copies), after synchronizing."""
        self._settled("master_weights()")
        self.synchronize()
        return {self.state.names[i]: s.master for i, s in self.export_states().items()}

    @contextlib.contextmanager
    def resident_weights(self) -> Iterator[None]:
        """Every streamed block resident inside (weight-flow; else a no-op): checkpoints, and
        writing streamed weights (adopted on the way out)."""
        with self.weights.resident():
            yield
            self.writes.adopt_written(where=" inside resident_weights()")

    def restore(self, states: Mapping[int, ParamState]) -> None:
        """Rebuild every bucket from ``states`` (a loaded checkpoint), forgetting any partial
        iteration."""
        self.scheduler.current = Iteration()
        self._build(states)
        self.contract.tainted = None  # loaded weights are consistent again

    def _settled(self, what: str) -> None:
        """Checkpoints and state dicts exist only between iterations (not between the last
        backward() and step(): buckets already stepped with this batch, the others not)."""
        self.raise_if_failed()
        if self.scheduler.current.micro_step >= self.config.grad_accum_steps:
            raise self.contract.refuse_mid_iteration(what)

    def state_dict(self) -> dict[str, Any]:
        self._settled("state_dict()")
        return checkpoint.engine_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """An engine state dict, or a ``torch.optim`` AdamW/Adam state dict (migrating a run:
        ``runtime/optim_view.py`` ``load_torch_state``)."""
        self._settled("load_state_dict()")
        if is_torch_state_dict(state_dict):
            load_torch_state(self, state_dict)
            return
        checkpoint.load_engine_state_dict(self, state_dict)

    def save_checkpoint(self, path: str, extra: Any = None, *,
                        lr_scheduler: Any = None) -> str:
        """Write ``path/engine.pt`` atomically (runtime/checkpoint.py); returns the file."""
        self._settled("save_checkpoint()")
        return checkpoint.save(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        """Restore everything ``save_checkpoint`` wrote; returns its ``extra``."""
        self._settled("load_checkpoint()")
        return checkpoint.load(self, path, lr_scheduler=lr_scheduler)

    def adopt_model_weights(self) -> None:
        """Make the weights the model holds now the optimizer's (its fp32 masters and host
        copies; the moments stay), as torch's optimizer would simply step from them -- after
        writes the engine refused, or when weights changed in ways it cannot see (a tensor
        subclass, C++ code). Synchronizes; between iterations only."""
        self._settled("adopt_model_weights()")
        self.writes.adopt_all()

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the engine's gradients: call it between the
        last ``backward()`` and ``step()`` (on every rank under data parallel: it reduces).
        Returns the total 2-norm of the unscaled gradient over every bucket and rank, as torch
        does (inf/nan when one is non-finite); ``step()`` then clips every bucket by
        ``max_norm`` (with ``OffloadConfig.max_grad_norm`` too: the smaller wins) under STV.
        ``foreach`` is accepted for signature compatibility (the engine has its own kernels)."""
        self.raise_if_failed()
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}): the engine clips by the "
                             "global 2-norm (the one its speculation validates); use norm_type=2")
        if not (isinstance(max_norm, int | float) and not isinstance(max_norm, bool)
                and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): use a positive finite "
                             "number (OffloadConfig.max_grad_norm=None disables clipping)")
        self._gradients_final("clip_grad_norm_()")
        norm, nonfinite = validate_early(self.scheduler, float(max_norm))
        if error_if_nonfinite and nonfinite:
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                "it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32)

    def _gradients_final(self, what: str) -> None:
        """``what`` reads this iteration's final gradients: after the last micro-step's
        backward, before ``step()``; a plain ``loss.backward()`` loop's buckets launch now."""
        it, gas = self.scheduler.current, self.config.grad_accum_steps
        done = micro_steps.done(self.scheduler)
        if done == 0:
            raise guard.ContractError(f"{what} before any backward() since the last step(): "
                                      "there is no gradient yet; call it after backward()")
        if done < gas:
            raise guard.ContractError(
                f"{what} after backward() {done} of {gas} (OffloadConfig.grad_accum_steps): "
                "the gradients are still accumulating; call it after the last micro-step's "
                "backward(), just before step()")
        if it.micro_step == 0:  # a plain loss.backward() loop: the buckets launch now
            micro_steps.check_plain_passes(self.scheduler, self.config, what)
            self._arm_without_backward()

    def grad_norm(self) -> float:
        """The global 2-norm of this iteration's unscaled gradient, over every bucket and
        rank: what ``step()`` clips by and ``clip_grad_norm_`` returns (inf/nan when one is
        non-finite), without clipping. Read-only; between the last micro-step's
        ``backward()`` and ``step()`` (on every rank under data parallel: it reduces), or
        after ``step()``: the norm that step validated."""
        self.raise_if_failed()
        sched = self.scheduler
        if micro_steps.done(sched) == 0 and sched.current.validated is None:
            if sched.last_grad_norm is None:
                raise guard.ContractError("grad_norm() before any backward(): there is no "
                                          "gradient yet; call it after backward()")
            return sched.last_grad_norm
        self._gradients_final("grad_norm()")
        return validate_early(sched, None)[0]

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient as a plain torch loop holds it in ``.grad`` (unscaled, summed
        over the micro-steps, averaged over data-parallel ranks), in fp32: a copy from its
        host buffer for an offloaded parameter (whose ``.grad`` left the device with its
        bucket), from the device for a GPU tail one; None when it got no gradient. Between
        the last micro-step's ``backward()`` and ``step()`` (DeepSpeed's
        ``safe_get_full_grad``). Read-only: change gradients with
        ``register_grad_transform``."""
        self.raise_if_failed()
        st, sched = self.state, self.scheduler
        i = st.index.get(id(param))
        if i is None or i not in st.bucket_of:
            raise ValueError("full_grad: the tensor is not a trainable parameter of the "
                             "engine's model (pass one of model.parameters())")
        self._gradients_final("full_grad()")
        flight = sched.current.flights.get(st.bucket_of[i])
        if flight is None or i not in flight.present:
            return None
        if flight.stats is not None:  # the move has landed (CUDA: its event too)
            sched.wait(flight.stats, f"gradients of bucket {flight.bucket}").resolve()
        g = self.transport.full_grad(i)
        if g is None:
            return None
        scale = sched.scaler.loss_scale * self.transport.grad_divisor
        return g.detach().to(torch.float32, copy=True).div_(scale)

    def register_grad_transform(self, fn: Any) -> RemovableHandle:
        """``fn(name, grad) -> Tensor | None`` runs on every gradient when it is final, before
        its bucket leaves (gradient noise, masking, per-parameter scaling...): edit ``grad`` in
        place or return a replacement of the same shape, dtype and device. Returns a handle
        (``.remove()``). The supported way to change gradients: an edit after ``backward()``
        raises (docs/failure_semantics.md). Plain ``loss.backward()`` then ``step()``: applied
        in ``step()``."""
        if not callable(fn):
            raise TypeError(f"register_grad_transform: {fn!r} is not callable")
        handle = RemovableHandle(self.scheduler.transforms)
        self.scheduler.transforms[handle.id] = fn
        return handle

    # ------------------------------------------------------------------ param groups
    def _add_param_group(self, param_group: dict[str, Any]) -> None:
        """``optimizer.add_param_group``: the group's parameters get buckets (a re-plan from the
        current state) and step from the next iteration with fresh moments, as torch's do."""
        self._settled("optimizer.add_param_group()")
        if self.weights.active == "flow":
            raise guard.ContractError(
                "optimizer.add_param_group() under weights='flow' is not supported (the streamed "
                "blocks are planned from the parameters present at initialize): list every "
                "group at so.initialize (a group may start with lr=0), or use "
                "weights='stationary'")
        group = new_group(param_group, self.optimizer.defaults)
        st = self.state
        new = []
        for p in group["params"]:
            i = st.index.get(id(p))
            if i is None:
                raise ValueError("add_param_group: a parameter does not belong to the engine's "
                                 "model; an engine trains one model")
            if i in st.group_of:
                raise ValueError(f"add_param_group: parameter {st.names[i]!r} is already in "
                                 f"param group {st.group_of[i]}; a parameter has one group")
            if p.dtype != st.model_dtype:
                raise TypeError(f"add_param_group: parameter {st.names[i]!r} is {p.dtype}, the "
                                f"trained ones {st.model_dtype}: cast it first")
            new.append(i)
        if not new:
            raise ValueError("add_param_group: no parameter with requires_grad=True; call "
                             "requires_grad_(True) on them first")
        self.synchronize()
        states = self.export_states()
        guard.claim([st.params[i] for i in new], self, [st.names[i] for i in new])
        self.optimizer.append_group(group)
        g = len(self.optimizer.param_groups) - 1
        for i in new:
            st.group_of[i] = g
            states[i] = initial_state(st.params[i])
        st.trainable = sorted(set(st.trainable) | set(new))
        # every data-parallel rank must add the same group (the re-plan below is collective)
        self.transport.agree(guard.fingerprint(st, self.config, self._hypers()))
        self._build(states)
        self.reinstall_hooks()
        self.contract.rebase(new)
        self.telemetry.note(self.iteration, f"param group {g} added: {len(new)} parameter(s) "
                                            "get buckets and train from the next step")

    def reinstall_hooks(self) -> None:
        """After a re-plan that changed the trainable set (add_param_group): the gradient and
        forward hooks follow the new buckets (``self.hooks`` is the list the finalizer holds)."""
        for h in self._core_hooks:
            h.remove()
        self.hooks[:] = [h for h in self.hooks if h not in self._core_hooks]
        self._core_hooks = engine_hooks.register(self.model, self.scheduler, self.raise_if_failed)
        self.hooks += self._core_hooks

    def supersede(self, why: str) -> None:
        """Another engine took the model (runtime/guard.py ``claim``): roll back a half
        iteration, close, and say ``why`` on any later call."""
        if self.closed:
            return
        if self.scheduler.current.micro_step and not self.failures.failed:
            with contextlib.suppress(Exception):  # a failure is reported by close() below
                self.scheduler.abort()
            # its offloaded gradients left with their buckets: drop the rest too, so the new
            # engine starts from no gradient rather than from half of this iteration's
            for p in self.trainable_params():
                p.grad = None
        self._closed_why = why
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "an OffloadEngine cannot be pickled (it holds threads, pinned buffers and hooks on "
            "the model): save it with engine.save_checkpoint(path) and restore with "
            "engine.load_checkpoint(path); the model itself pickles (torch.save(model))")
