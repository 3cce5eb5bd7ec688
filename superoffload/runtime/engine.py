"""The offload engine (paper §4; DESIGN.md §3): the public facade over one iteration core.

Forward with the device weights (each module waits only for its own bucket's publish);
backward, where a bucket is offloaded the moment its last gradient is final and stepped
speculatively on the CPU; ``step()`` validates, rolls back / replays / skips as the verdict
says, and steps the GPU tail buckets on the device. ``EngineState`` (state.py) books the
parameters and buckets; ``plan.schedule.resolve_schedule`` decides what runs (the planner
calls it too, runtime/build.py); a ``Transport`` moves gradients and weights
(``LocalTransport`` here, FSDP2's in ``superoffload.distributed.fsdp``: the same engine).
``backward()`` and ``step()`` hold the phase order; each phase is a function of the frozen
iteration (runtime/launch.py, runtime/stv.py; the reading order: runtime/__init__.py). A
lane's exception is raised in the training thread at its next call as an ``EngineError``.
docs/engine.md, "The parts".

Past 400 lines: one concept, the engine's public API -- what a training loop calls, in the
order a step runs it; each method is the phase order or a few lines over the modules that do
the work, and splitting the class would make a mixin, not a concept.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from superoffload.config import RECONFIGURABLE, OffloadConfig
from superoffload.kernels.hyper import AdamHyper, hypers_of
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.schedule import Schedule, ScheduleFacts, engine_for
from superoffload.runtime import build, checkpoint, contract, stv
from superoffload.runtime.auto_rollback import check_rollback_mode
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.deprecated import DeprecatedAlias, renamed_keyword
from superoffload.runtime.device_clock import CudaClock
from superoffload.runtime.devices import DeviceOps, make_device_ops
from superoffload.runtime.errors import (
    EngineClosed,
    EngineError,
    FailureBox,
    IterationInterrupted,
    WatchdogTimeout,
)
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.iteration import EngineStats, Parts
from superoffload.runtime.lanes import Barrier, Lane, make_lane
from superoffload.runtime.launch import (
    Launcher,
    check_backward,
    check_plain_passes,
    grad_hooks,
    passes,
)
from superoffload.runtime.lifetime import quiesce, release
from superoffload.runtime.local_transport import LocalTransport
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import (
    EngineOptimizer,
    defaults_from,
    is_torch_state_dict,
    load_torch_state,
    new_group,
    new_params,
    param_groups_from,
)
from superoffload.runtime.publishes import Publishes, forward_hooks
from superoffload.runtime.reconfigure import Reconfigurer
from superoffload.runtime.state import EngineState, InitialStates, ParamState, initial_state
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.tier import StateTier
from superoffload.runtime.transfers import InFlight
from superoffload.runtime.transport import Transport, TransportContext
from superoffload.runtime.weight_writes import WeightWrites
from superoffload.runtime.weightflow import WeightFlow
from superoffload.runtime.weights import WeightPolicyController
from superoffload.telemetry.events import KIND_BACKWARD, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder
from superoffload.threads import usable_cores

__all__ = ["OffloadEngine"]


class OffloadEngine:
    """See the module docstring; build with ``superoffload.initialize``. What a training loop
    may do with it as with a ``torch.optim`` optimizer (state dicts, checkpoints, clipping,
    ``add_param_group``...) it does the same or refuses at once naming the supported way
    (docs/failure_semantics.md, "What you may do with the engine")."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
        config: OffloadConfig,
        telemetry: Recorder | None = None,
        *,
        inline: bool = False,
        device_ops: DeviceOps | None = None,
        backend: DeviceOps | None = None,
        profile: HardwareProfile | str | None = None,
        seq_len: int | None = None,
        micro_batch: int | None = None,
        device_budget_bytes: int | None = None,
        transport: Transport | None = None,
    ) -> None:
        """``profile``, ``seq_len``, ``micro_batch``: what weights="auto" (and casting="auto" on
        a GPU) asks the planner with; ``device_budget_bytes``: the device memory that choice
        and a switch back to weight-stationary may assume (a cap; tests use it on the CPU);
        ``transport``: how data moves (default: one process, D2H/H2D)."""
        self.config = config.validate()
        self.model = model
        self.transport: Transport = transport or LocalTransport()
        self.telemetry = telemetry or Recorder(enabled=config.telemetry,
                                               max_events=config.telemetry_max_events,
                                               rank=self.transport.rank)
        self.device_ops = renamed_keyword("backend", backend, "device_ops", device_ops) \
            or make_device_ops(config.device, pin_memory=config.pin_memory)
        if self.device_ops.device.type == "cuda":  # device spans on the GPU's clock
            self.telemetry.clock = CudaClock(self.device_ops.device, self.telemetry.now)
        self.failures = FailureBox()
        self.closed = False
        self._closed_why = ""
        groups = param_groups_from(model, optimizer)
        self.state = EngineState.from_model(model, groups)
        self.state.check_placement(self.device_ops.device, config.precision)
        contract.claim(self.trainable_params(), self, [self.state.names[i] for i in self.state.trainable])
        self.contract = contract.Contract(self.state)
        self.optimizer = EngineOptimizer(groups, step_fn=self._step,
                                         zero_grad_fn=self.zero_grad,
                                         state_fn=self.state_dict, load_fn=self.load_state_dict,
                                         add_group_fn=self._add_param_group,
                                         defaults=defaults_from(optimizer))
        hypers = self._hypers()  # checks the rollback mode against the groups at once
        self.scaler = LossScaler.for_model(config, self.model_dtype)
        self.adaptive = AdaptiveSTV(mode=config.speculation, window=config.adaptive_window,
                                    threshold=config.adaptive_threshold)
        # none of the parts below holds the engine: their futures' callbacks outlive a call
        # on the lane threads and must not keep a dropped engine alive (lifetime.py); what an
        # iteration reads of it is frozen when the iteration begins (frozen.py)
        self.cpu_worker: Lane = make_lane("cpu_worker", inline=inline, on_error=self.failures.record)
        self.fetch_lane: Lane = make_lane("fetch", inline=inline, on_error=self.failures.record)
        self.in_flight = InFlight(self.failures, self.transport.stall_hint)
        self.transport.start(TransportContext(
            state=self.state, device_ops=self.device_ops, recorder=self.telemetry, inline=inline,
            on_error=self.failures.record, in_flight=self.in_flight,
            fingerprint=contract.fingerprint(self.state, self.config, hypers)))
        self.accum_on_host = False  # the resolved grad_accum_on is "host" (set by builds)
        self.cast: CastPolicy | None = None  # the casting in force (set by builds)
        self.publishes = Publishes(
            state=self.state, contract=self.contract, device_ops=self.device_ops,
            recorder=self.telemetry, transport=self.transport, in_flight=self.in_flight)
        self.parts = Parts(state=self.state, transport=self.transport, contract=self.contract,
                           cpu_worker=self.cpu_worker, publishes=self.publishes, in_flight=self.in_flight,
                           recorder=self.telemetry, stats=EngineStats())
        start = FrozenIteration(  # what a forward before the first iteration waits with
            number=0, config=self.config, streamed=frozenset(), loss_scale=self.scaler.loss_scale,
            threads=1, speculate=self.adaptive.enabled, accum_on_host=False)
        self.launcher = Launcher(self.parts, self.device_ops, start)
        self.last_grad_norm: float | None = None  # the last step's (grad_norm())
        self.reconfigurer = Reconfigurer(self)
        self.weights = WeightPolicyController(
            self, profile=profile, seq_len=seq_len, micro_batch=micro_batch,
            device_budget_bytes=device_budget_bytes)
        self._last_step_end = time.perf_counter()
        self.writes = WeightWrites(
            state=self.state, contract=self.contract, launcher=self.launcher,
            transport=self.transport, recorder=self.telemetry, weights=self.weights,
            synchronize=self.synchronize)
        self._build(InitialStates(self.state.params, self.state.trainable))
        self._core_hooks = grad_hooks(self.launcher) + forward_hooks(
            model, self.publishes, self.launcher, self.weights, self.raise_if_failed)
        self.hooks: list[Any] = list(self._core_hooks)
        self.weights.start()  # weight-flow adds its hooks to self.hooks
        self.hooks += self.writes.register(model)
        # dropped without close(): stop the threads and remove the hooks (the model must not
        # keep a dead engine alive, nor a new engine on it see this one's hooks)
        self._finalizer = weakref.finalize(self, release, self.lanes, self.hooks)

    # ------------------------------------------------------------------ views
    backend, worker = DeprecatedAlias("device_ops"), DeprecatedAlias("cpu_worker")  # old names
    @property
    def lanes(self) -> tuple[Lane, ...]:
        return (*self.transport.lanes, self.cpu_worker, self.fetch_lane)

    @property
    def iteration(self) -> int:
        """Optimizer iterations completed (the next one's number)."""
        return self.launcher.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.launcher.iteration = int(value)

    @property
    def stats(self) -> EngineStats:
        return self.parts.stats

    @property
    def model_dtype(self) -> torch.dtype:
        return self.state.model_dtype

    @property
    def schedule(self) -> Schedule:
        """The schedule in force: effective ratio, bucket table, casting, threads."""
        assert self.state.schedule is not None
        return self.state.schedule

    @property
    def bucket_plan(self) -> Any:  # the schedule's buckets
        return self.schedule.bucket_plan

    @property
    def reconfigurable(self) -> frozenset[str]:
        """What ``reconfigure`` accepts while training."""
        return RECONFIGURABLE

    def trainable_params(self) -> list[torch.nn.Parameter]:
        """The parameters the engine steps, in parameter-index order."""
        return [self.state.params[i] for i in self.state.trainable]

    # ------------------------------------------------------------------ building
    def _facts(self) -> ScheduleFacts:
        cfg, cuda = self.config, self.device_ops.device.type == "cuda"
        auto_cast = "auto" in (cfg.grad_cast, cfg.param_cast) and self.model_dtype != torch.float32
        return ScheduleFacts(
            params=self.state.param_specs(), model_dtype=self.state.dtype_name,
            device_type=self.device_ops.device.type, dp=self.transport.grad_divisor,
            usable_cores=usable_cores(), local_ranks=self.transport.local_ranks,
            profile=self.weights.profile() if cuda and auto_cast else None,
            engine=engine_for(cfg))  # the planner's rule: the planner predicts this engine

    def _build(self, states: Mapping[int, ParamState]) -> None:
        """Resolve the schedule and (re)allocate every bucket from placement-free ``states``."""
        build.build(self, states, self._facts())

    def rebuild(self) -> None:
        """Re-plan the buckets from the current state (after a drain; a weight policy switch)."""
        self._build(self.transport.export_states())

    def refresh_schedule(self) -> None:
        build.refresh(self, self._facts())

    def forget_iteration(self) -> None:
        """Forget a partial iteration (after a load or a rebuild)."""
        self.launcher.forget()
        self.publishes.home_ready.clear()

    def new_flow(self, depth: int) -> WeightFlow:
        return WeightFlow(self.model, self.launcher, self.device_ops, self.transport.home, depth,
                          self.fetch_lane)

    # ------------------------------------------------------------------ training API
    def _hypers(self) -> list[AdamHyper]:
        hypers = hypers_of(self.optimizer.param_groups)
        check_rollback_mode(self.config.rollback, self.config.speculation, hypers)
        return hypers

    def _freeze(self, *, speculate: bool, accum_on_host: bool,
                hypers: Sequence[AdamHyper] = ()) -> FrozenIteration:
        """What the iteration beginning now reads once (runtime/frozen.py)."""
        return FrozenIteration(
            number=self.iteration, config=self.config, streamed=self._streamed(),
            loss_scale=self.scaler.loss_scale, threads=self.schedule.threads,
            speculate=speculate, accum_on_host=accum_on_host, hypers=tuple(hypers))

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-step; offloads buckets as their gradients become final.
        ``scale_wrt_gas`` (DeepSpeed's name): False when the caller already divided the loss
        by ``grad_accum_steps``. Interrupted, the iteration is rolled back
        (docs/failure_semantics.md)."""
        self.raise_if_failed()
        launcher = self.launcher
        check_backward(launcher.current, self.config, accum_on_host=self.accum_on_host,
                       transforms=bool(launcher.transforms))
        if launcher.current.micro_step == 0:
            self._at_boundary()
            launcher.begin(self._freeze(speculate=self.adaptive.enabled,
                                        accum_on_host=self.accum_on_host))
        last = launcher.current.micro_step + 1 >= self.config.grad_accum_steps
        it = launcher.micro_step(self._hypers() if last else None)
        scale = it.frozen.loss_scale / (self.config.grad_accum_steps if scale_wrt_gas else 1)
        try:
            try:
                launcher.in_engine_backward = True  # the gradient hooks tell the user's passes
                with self.telemetry.device_span(LANE_COMPUTE, KIND_BACKWARD,
                                                iteration=self.iteration):
                    (loss * scale if scale != 1.0 else loss).backward()
            finally:
                launcher.in_engine_backward = False
                self._end_backward()
            it.losses.append(loss.detach())
            if it.armed:
                launcher.launch_remaining()  # buckets some of whose params got no grad
            elif it.frozen.accum_on_host:
                launcher.accumulate_remaining()  # this micro-step's gradients all leave
        except BaseException as exc:
            self._interrupted(exc, "backward()")
            raise
        self.raise_if_failed()

    def step(self) -> None:
        """Optimizer step at the end of gradient accumulation (a no-op before it), `_step`.
        torch's step hooks run around it as around ``optimizer.step()`` (which calls `_step`
        too), so hooks see every iteration however the loop steps: the auto-calibration and
        the A/B trial listen there (runtime/step_listener.py)."""
        # LR schedulers wrap optimizer.step to note that it ran and warn otherwise; this is
        # the optimizer's step, so it notes it itself (tests/test_lr_scheduler.py)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        # the body under torch's pre/post step hooks, as torch wraps optimizer.step (built per
        # call: an attribute would tie the engine to itself and delay its release, lifetime.py)
        torch.optim.Optimizer.profile_hook_step(lambda optimizer: self._step())(self.optimizer)

    def _step(self) -> None:
        """The step itself: validate, decide, settle, close (runtime/stv.py)."""
        self.raise_if_failed()
        if 0 < passes(self.launcher.current) < self.config.grad_accum_steps:
            return  # DeepSpeed semantics: step() every micro-step, acts on the boundary
        try:
            self._end_backward()
            if self.launcher.current.micro_step == 0:  # a plain loss.backward(): no overlap, no STV
                check_plain_passes(self.launcher.current, self.config, "step()")
                self._arm_without_backward()
            it, parts = self.launcher.current, self.parts
            glob = stv.validate(it, parts) if it.validated is None else \
                stv.check_again(it, parts, it.validated)  # clip_grad_norm_ validated already
            v = stv.decide(it, parts, glob)
            it.settling = True  # from here an interruption leaves the iteration half-settled
            stv.settle(it, v, glob, parts)
            stv.close_iteration(it, v, glob, parts, scaler=self.scaler, adaptive=self.adaptive)
            self.last_grad_norm = v.grad_norm
        except contract.ContractError:  # the same on every rank: roll the iteration back
            self._abort()
            self.synchronize()
            raise
        except BaseException as exc:
            self._interrupted(exc, "step()")
            raise
        n, flow = it.frozen.number, self.weights.flow
        self.telemetry.scalar("weights_flow", n, 1.0 if self.weights.active == "flow" else 0.0)
        self.telemetry.scalar("device_weight_bytes", n, float(self.weights.fixed_weight_bytes + (
            flow.iteration_peak_bytes if flow is not None else 0)))
        if flow is not None:
            flow.iteration_peak_bytes = flow.held_bytes
        now = time.perf_counter()
        self.telemetry.scalar("iteration_s", n, now - self._last_step_end)
        self._last_step_end = now
        self.launcher.next_iteration()
        self.raise_if_failed()

    def _at_boundary(self) -> None:
        """Where an iteration begins: apply what ``reconfigure()`` queued, adopt weights
        written since the last step (torch semantics) -- each a plain check first, the call
        only when something happened."""
        if self.reconfigurer.pending:
            self.reconfigurer.apply_pending()
        if self.contract.tainted is not None or self.contract.written(self.state.trainable,
                                                                     self._streamed()):
            self.writes.adopt_written()

    def _streamed(self) -> frozenset[int]:
        flow = self.weights.flow
        return flow.streamed_indices if flow is not None else frozenset()

    def _end_backward(self) -> None:
        flow = self.weights.flow
        if flow is not None:  # nothing streamed stays resident
            flow.end_backward()

    def _arm_without_backward(self) -> None:
        self._at_boundary()
        self.launcher.arm_without_backward(
            self._freeze(speculate=False, accum_on_host=False, hypers=self._hypers()))

    def _abort(self) -> None:
        """Undo the iteration in progress (runtime/stv.py ``abort``); drain afterwards."""
        frozen = self.launcher.current.frozen
        stv.abort(self.launcher.disarm(), frozen, self.parts)
        self.launcher.forget()

    def _interrupted(self, exc: BaseException, where: str) -> None:
        """An iteration will not finish (``exc`` in ``where``): undo it, or refuse to go on --
        never a silent mix of two batches. Before ``step()`` acted on its verdict, and when
        the ranks do not step together (``Transport.collective``): roll back. Half-settled,
        or under data parallel (the other ranks' collectives no longer match this rank's):
        the engine fails, saying how to recover."""
        if isinstance(exc, EngineError) or self.failures.failed:
            return  # a lane failure: already the engine's error
        it = self.launcher.current
        if not it.settling and not self.transport.collective:
            try:
                self._abort()
                self.synchronize()
                self.telemetry.note(self.iteration, f"{where} interrupted ({type(exc).__name__}"
                                    "): the iteration was rolled back; train on from here")
                return
            except BaseException as cause:  # the engine fails below
                exc = cause
        why = ("while settling the verdict" if it.settling else "under data parallel: the "
               "other ranks' collectives no longer match this rank's, so")
        self.failures.record("training", IterationInterrupted(
            f"{where} was interrupted ({exc!r}) {why} the iteration cannot be undone; the "
            "engine stops rather than train on a mix of two batches. Recover: load the last "
            "checkpoint into a new engine (engine.load_checkpoint; under data parallel on "
            "every rank), or build a new engine from the model's current weights"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: drop the gradients (``optimizer.zero_grad()`` calls this); between the
        last backward and ``step()`` the iteration is discarded, mid-accumulation nothing."""
        it = self.launcher.current
        if 0 < passes(it) < self.config.grad_accum_steps:
            return  # mid-accumulation: keep the partial sums
        if it.micro_step:  # after backward, before step(): discard the iteration, as torch
            self.raise_if_failed()  # drops the gradients and its step does nothing
            self._abort()
            self.synchronize()
        it.plain.clear()  # the user's own backward passes are discarded with their sums
        for i in self.state.trainable:
            p = self.state.params[i]
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
        self.raise_if_failed()
        threshold = stv.check_clip_args(max_norm, norm_type)
        self._gradients_final("clip_grad_norm_()")
        return stv.clip_grad_norm(self.launcher.current, self.parts, threshold, error_if_nonfinite)

    def grad_norm(self) -> float:
        """The global 2-norm of this iteration's unscaled gradient, over every bucket and
        rank: what ``step()`` clips by and ``clip_grad_norm_`` returns (inf/nan when one is
        non-finite), without clipping. Read-only; between the last micro-step's
        ``backward()`` and ``step()`` (on every rank under data parallel: it reduces), or
        after ``step()``: the norm that step validated."""
        self.raise_if_failed()
        it = self.launcher.current
        if passes(it) == 0 and it.validated is None:
            if self.last_grad_norm is None:
                raise contract.ContractError("grad_norm() before any backward(): there is no "
                                          "gradient yet; call it after backward()")
            return self.last_grad_norm
        self._gradients_final("grad_norm()")
        return stv.validate_early(self.launcher.current, self.parts, None)[0]

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient as a plain torch loop holds it in ``.grad`` (unscaled, summed
        over the micro-steps, averaged over data-parallel ranks), in fp32: a copy from its
        host buffer for an offloaded parameter (whose ``.grad`` left the device with its
        bucket), from the device for a GPU tail one; None when it got no gradient. Between
        the last micro-step's ``backward()`` and ``step()`` (DeepSpeed's
        ``safe_get_full_grad``). Read-only: change gradients with
        ``register_grad_transform``."""
        self.raise_if_failed()
        i = self.state.index.get(id(param))
        if i is None or i not in self.state.bucket_of:
            raise ValueError("full_grad: the tensor is not a trainable parameter of the "
                             "engine's model (pass one of model.parameters())")
        self._gradients_final("full_grad()")
        return stv.full_grad(self.launcher.current, self.parts, i)

    def register_grad_transform(self, fn: Any) -> RemovableHandle:
        """``fn(name, grad) -> Tensor | None`` runs on every gradient when it is final, before
        its bucket leaves (gradient noise, masking, per-parameter scaling...): edit ``grad`` in
        place or return a replacement of the same shape, dtype and device. Returns a handle
        (``.remove()``). The supported way to change gradients: an edit after ``backward()``
        raises (docs/failure_semantics.md). Plain ``loss.backward()`` then ``step()``: applied
        in ``step()``."""
        return self.launcher.register_transform(fn)

    def _gradients_final(self, what: str) -> None:
        """``what`` reads this iteration's final gradients: after the last micro-step's
        backward, before ``step()``; a plain ``loss.backward()`` loop's buckets launch now."""
        it, gas = self.launcher.current, self.config.grad_accum_steps
        done = passes(it)
        if done == 0:
            raise contract.ContractError(f"{what} before any backward() since the last step(): "
                                      "there is no gradient yet; call it after backward()")
        if done < gas:
            raise contract.ContractError(
                f"{what} after backward() {done} of {gas} (OffloadConfig.grad_accum_steps): "
                "the gradients are still accumulating; call it after the last micro-step's "
                "backward(), just before step()")
        if it.micro_step == 0:  # a plain loss.backward() loop: the buckets launch now
            check_plain_passes(it, self.config, what)
            self._arm_without_backward()

    # ------------------------------------------------------------------ state, checkpoints
    def _settled(self, what: str) -> None:
        """Checkpoints and state dicts exist only between iterations (not between the last
        backward() and step(): buckets already stepped with this batch, the others not)."""
        self.raise_if_failed()
        if self.launcher.current.micro_step >= self.config.grad_accum_steps:
            raise self.contract.refuse_mid_iteration(what)

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]:
        """Placement-free copies of every trainable parameter's state (call synchronized);
        ``tier=False``: without the storage tier's (a checkpoint streams those itself)."""
        return self.transport.export_states(tier=tier)

    @property
    def tier(self) -> StateTier | None:
        """The storage tier holding some offloaded buckets' state (docs/storage.md), or None."""
        return self.transport.tier

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
        self.forget_iteration()
        self._build(states)
        self.contract.tainted = None  # loaded weights are consistent again

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

    def _add_param_group(self, param_group: dict[str, Any]) -> None:
        """``optimizer.add_param_group``: the group's parameters get buckets (a re-plan from the
        current state) and step from the next iteration with fresh moments, as torch's do."""
        self._settled("optimizer.add_param_group()")
        if self.weights.active == "flow":
            raise contract.ContractError(
                "optimizer.add_param_group() under weights='flow' is not supported (the streamed "
                "blocks are planned from the parameters present at initialize): list every "
                "group at so.initialize (a group may start with lr=0), or use "
                "weights='stationary'")
        group, st = new_group(param_group, self.optimizer.defaults), self.state
        new = new_params(group, st)
        self.synchronize()
        states = self.export_states()
        contract.claim([st.params[i] for i in new], self, [st.names[i] for i in new])
        self.optimizer.append_group(group)
        g = len(self.optimizer.param_groups) - 1
        for i in new:
            st.group_of[i] = g
            states[i] = initial_state(st.params[i])
        st.trainable = sorted(set(st.trainable) | set(new))
        # every data-parallel rank must add the same group (the re-plan below is collective)
        self.transport.agree(contract.fingerprint(st, self.config, self._hypers()))
        self._build(states)
        self.reinstall_hooks()
        self.contract.rebase(new)
        self.telemetry.note(self.iteration, f"param group {g} added: {len(new)} parameter(s) "
                                            "get buckets and train from the next step")

    # ------------------------------------------------------------------ lanes, lifetime
    def synchronize(self) -> None:
        """Wait for all in-flight work; then the parameters hold the latest weights."""
        self.raise_if_failed()
        self._drain()
        if isinstance(self.telemetry.clock, CudaClock):
            self.telemetry.flush()
            self.telemetry.clock.calibrate()  # the GPU and host clocks drift (ppm)
        self.raise_if_failed()

    def _drain(self) -> None:
        """Every lane has run what was submitted to it (a barrier on each, in turn), every
        future the training thread submitted is done, every publish has landed."""
        watchdog = self.config.watchdog_s
        for lane in self.lanes:
            self.in_flight.quiet(lane, lane.submit(Barrier()), watchdog)
        self.in_flight.wait_all(watchdog)
        self.publishes.discard_racing_writes()

    def reconfigure(self, **changes: Any) -> None:
        """Thread-safe; applied at the next iteration boundary with a telemetry note."""
        self.reconfigurer.request(changes)

    def raise_if_failed(self) -> None:
        if self.closed:
            why = f" ({self._closed_why})" if self._closed_why else ""
            raise EngineClosed(f"the offload engine is closed{why}; build a new one with "
                               "superoffload.initialize (the model keeps its latest weights)")
        if self.failures.failed:
            self._shut_down()  # a failed engine lets go of the model at once
            self.failures.raise_if_failed()

    @property
    def alive(self) -> bool:
        """Neither closed nor failed (a failed engine has let go of the model)."""
        return not (self.closed or self.failures.failed)

    def _shut_down(self) -> None:
        """Stop the lanes, remove every hook, leave the model holding its latest weights
        (weight-flow: copied back from the homes without the lanes). Idempotent."""
        self._finalizer()
        contract.release(self.trainable_params(), self)
        flow, self.weights.flow = self.weights.flow, None
        if flow is not None:
            flow.restore_in_place()

    def close(self) -> None:
        """Drain and stop the lanes, remove the hooks, release the buffers. Idempotent.
        Cleanup always completes; it raises only a lane failure no call has reported yet, or
        a WatchdogTimeout naming a lane that made no progress for CLOSE_TIMEOUT_S (lifetime.py)."""
        if self.closed:
            return
        seen = self.failures.reported
        stuck = None if self.failures.failed else quiesce(self.lanes)
        if not self.failures.failed and stuck is None:
            with contextlib.suppress(Exception):  # a lane's failure is kept: raised below
                self._drain()
        self.closed = True
        self._shut_down()
        self.transport.close()
        self.publishes.pending.clear()
        self.forget_iteration()
        self.state.buffers = []
        if self.failures.failed and not seen:
            self.failures.raise_if_failed()
        if stuck is not None:
            raise WatchdogTimeout(f"close(): {stuck}; abandoned (buckets not finished keep "
                                  "their weights from before the last step)")

    def reinstall_hooks(self) -> None:
        """After a re-plan that changed the trainable set (add_param_group): the gradient and
        forward hooks follow the new buckets (``self.hooks`` is the list the finalizer holds)."""
        for h in self._core_hooks:
            h.remove()
        self.hooks[:] = [h for h in self.hooks if h not in self._core_hooks]
        self._core_hooks = grad_hooks(self.launcher) + forward_hooks(
            self.model, self.publishes, self.launcher, self.weights, self.raise_if_failed)
        self.hooks += self._core_hooks

    def supersede(self, why: str) -> None:
        """Another engine took the model (runtime/contract.py ``claim``): roll back a half
        iteration, close, and say ``why`` on any later call."""
        if self.closed:
            return
        if self.launcher.current.micro_step and not self.failures.failed:
            with contextlib.suppress(Exception):  # a failure is reported by close() below
                self._abort()
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

    def __enter__(self) -> OffloadEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

