"""The offload engine (paper §4; DESIGN.md §3): the public facade over one iteration core.

Forward with the device weights (each module waits only for its own bucket's publish);
backward, where a bucket is offloaded the moment its last gradient is final and stepped
speculatively on the CPU; ``step()`` validates, rolls back / replays / skips as the verdict
says, and steps the GPU tail buckets on the device. ``EngineState`` (state.py) books the
parameters and buckets; ``plan.schedule.resolve_schedule`` decides what runs (the planner
calls it too); a ``Transport`` moves gradients and weights (``LocalTransport`` here, FSDP2's in
``superoffload.distributed.fsdp``: the same engine); ``IterationScheduler`` (scheduler.py,
settle.py) runs the bucket lifecycle. A lane's exception is raised in the training thread at
its next call as an ``EngineError``. docs/engine.md, "The parts".
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superoffload.config import RECONFIGURABLE, OffloadConfig
from superoffload.kernels import AdamHyper
from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.schedule import Schedule, ScheduleFacts, engine_for, resolve_schedule
from superoffload.runtime import guard, micro_steps
from superoffload.runtime import hooks as engine_hooks
from superoffload.runtime.backend import Backend, make_backend
from superoffload.runtime.casting import CastPolicy, cast_policy
from superoffload.runtime.departures import resolve_grad_accum
from superoffload.runtime.device_clock import CudaClock
from superoffload.runtime.engine_contract import TorchContract
from superoffload.runtime.errors import EngineClosed, EngineError, FailureBox, WatchdogTimeout
from superoffload.runtime.lifetime import WeakEngineView, release, settle
from superoffload.runtime.local_transport import LocalTransport
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import (
    EngineOptimizer,
    defaults_from,
    hypers_of,
    param_groups_from,
)
from superoffload.runtime.reconfigure import Reconfigurer
from superoffload.runtime.rollback_guard import check_rollback_mode
from superoffload.runtime.scheduler import EngineStats, IterationScheduler
from superoffload.runtime.settle import finish_iteration
from superoffload.runtime.state import EngineState, ParamState, initial_state
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.transport import Transport, TransportContext
from superoffload.runtime.weight_writes import WeightWrites
from superoffload.runtime.weightflow import WeightFlow
from superoffload.runtime.weights import WeightPolicyController
from superoffload.runtime.worker import Lane, make_lane
from superoffload.telemetry.events import KIND_BACKWARD, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder
from superoffload.threads import usable_cores

__all__ = ["EngineError", "EngineStats", "OffloadEngine"]


class OffloadEngine(TorchContract):
    """See the module docstring; build with ``superoffload.initialize``. The torch-optimizer
    surface (state dicts, checkpoints, clipping, add_param_group...) is ``TorchContract``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
        config: OffloadConfig,
        telemetry: Recorder | None = None,
        *,
        inline: bool = False,
        backend: Backend | None = None,
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
        self.backend = backend or make_backend(config.device, pin_memory=config.pin_memory)
        if self.backend.device.type == "cuda":  # device spans on the GPU's clock (issue 11)
            self.telemetry.clock = CudaClock(self.backend.device, self.telemetry.now)
        self.failures = FailureBox()
        self.closed = False
        self._closed_why = ""
        groups = param_groups_from(model, optimizer)
        self.state = EngineState.from_model(model, groups)
        self.state.check_placement(self.backend.device, config.precision)
        guard.claim(self.trainable_params(), self, [self.state.names[i] for i in self.state.trainable])
        self.contract = guard.Contract(self.state)
        self.optimizer = EngineOptimizer(groups, step_fn=self._step_impl,
                                         zero_grad_fn=self._zero_grad_impl,
                                         state_fn=self.state_dict, load_fn=self.load_state_dict,
                                         add_group_fn=self._add_param_group,
                                         defaults=defaults_from(optimizer))
        hypers = self._hypers()  # checks the rollback mode against the groups at once
        self.scaler = LossScaler.for_model(config, self.model_dtype)
        self.adaptive = AdaptiveSTV(mode=config.speculation, window=config.adaptive_window,
                                    threshold=config.adaptive_threshold)
        # the parts below reach the engine only weakly: their futures' callbacks outlive a
        # call on the lane threads, and must not keep a dropped engine alive (lifetime.py)
        view = WeakEngineView(self)
        self.worker: Lane = make_lane("cpu_worker", inline=inline, on_error=self.failures.record)
        self.fetch_lane: Lane = make_lane("fetch", inline=inline, on_error=self.failures.record)
        self.transport.start(TransportContext(
            state=self.state, backend=self.backend, recorder=self.telemetry, inline=inline,
            on_error=self.failures.record, watchdog_s=view.watchdog_s,
            fingerprint=guard.fingerprint(self.state, self.config, hypers)))
        self.scheduler = IterationScheduler(
            state=self.state, transport=self.transport, backend=self.backend,
            recorder=self.telemetry, worker=self.worker, config=view.config,
            scaler=self.scaler, adaptive=self.adaptive, failures=self.failures,
            streamed=view.streamed, contract=self.contract)
        self.reconfigurer = Reconfigurer(self)
        self.weights = WeightPolicyController(
            self, profile=profile, seq_len=seq_len, micro_batch=micro_batch,
            device_budget_bytes=device_budget_bytes)
        self._last_step_end = time.perf_counter()
        self.writes = WeightWrites(
            state=self.state, contract=self.contract, scheduler=self.scheduler,
            transport=self.transport, recorder=self.telemetry, weights=self.weights,
            synchronize=self.synchronize)
        self._build({i: initial_state(self.state.params[i]) for i in self.state.trainable})
        self._core_hooks = engine_hooks.register(model, self.scheduler, self.raise_if_failed)
        self.hooks: list[Any] = list(self._core_hooks)
        self.hooks += self.weights.start()  # weight-flow adds its own to this list
        self.hooks += self.writes.register(model)
        # dropped without close(): stop the threads and remove the hooks (the model must not
        # keep a dead engine alive, nor a new engine on it see this one's hooks)
        self._finalizer = weakref.finalize(self, release, self.lanes, self.hooks)

    # ------------------------------------------------------------------ views
    @property
    def lanes(self) -> tuple[Lane, ...]:
        return (*self.transport.lanes, self.worker, self.fetch_lane)

    @property
    def iteration(self) -> int:
        """Optimizer iterations completed (the next one's number)."""
        return self.scheduler.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.scheduler.iteration = int(value)

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

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

    # ------------------------------------------------------------------ building
    def _facts(self) -> ScheduleFacts:
        cfg, cuda = self.config, self.backend.device.type == "cuda"
        auto_cast = "auto" in (cfg.grad_cast, cfg.param_cast) and self.model_dtype != torch.float32
        return ScheduleFacts(
            params=self.state.param_specs(), model_dtype=self.state.dtype_name,
            device_type=self.backend.device.type, dp=self.transport.grad_divisor,
            usable_cores=usable_cores(), local_ranks=self.transport.local_ranks,
            profile=self.weights.profile() if cuda and auto_cast else None,
            engine=engine_for(cfg))  # the planner's rule: the planner predicts this engine

    def _build(self, states: Mapping[int, ParamState]) -> None:
        """Resolve the schedule and (re)allocate every bucket from placement-free ``states``."""
        st = self.state
        place, why = resolve_grad_accum(self.config, self.backend.device.type, self.transport,
                                        self.weights.shape_for_planning, self.weights.profile,
                                        self.weights.active)
        if why:  # "auto": the planner's cost model decided (runtime/departures.py)
            self.telemetry.note(self.iteration, f"grad_accum_on='auto': {place} ({why})")
        schedule = resolve_schedule(self.config, self._facts(), weights=self.weights.active,
                                    grad_accum=place)
        self.scheduler.sum_on_host = place == "host"
        self.cast: CastPolicy = cast_policy(schedule, self.model_dtype,
                                            sum_on_host=self.scheduler.sum_on_host)
        st.schedule = schedule
        st.bucket_of = {i: b.id for b in schedule.bucket_plan.buckets for i in b.param_indices}
        st.buffers = self.transport.build(
            schedule.bucket_plan, states, self.cast, flow=schedule.weights == "flow",
            snapshot=self.config.rollback == "snapshot",
            moments=torch.bfloat16 if self.config.optimizer_state_dtype == "bf16" else torch.float32)
        for i in st.trainable:
            st.steps[i] = states[i].step
        self.contract.rebase(st.trainable)  # storages may have moved (a weight policy switch)
        self.scheduler.reset()
        for note in schedule.notes:
            self.telemetry.note(self.iteration, note)

    def rebuild(self) -> None:
        """Re-plan the buckets from the current state (after a drain; a weight policy switch)."""
        self._build(self.transport.export_states())

    def refresh_schedule(self) -> None:
        schedule = resolve_schedule(self.config, self._facts(), weights=self.weights.active,
                                    grad_accum=self.schedule.grad_accum_on)
        old = self.schedule
        if (schedule.bucket_plan, schedule.grad_cast, schedule.param_cast) != (
                old.bucket_plan, old.grad_cast, old.param_cast):
            self.synchronize()
            self.rebuild()
        else:
            self.state.schedule = schedule

    def new_flow(self, depth: int) -> WeightFlow:
        return WeightFlow(self.model, self.scheduler, self.transport.home, depth, self.fetch_lane)

    # ------------------------------------------------------------------ training API
    def _hypers(self) -> list[AdamHyper]:
        hypers = hypers_of(self.optimizer.param_groups)
        check_rollback_mode(self.config.rollback, self.config.speculation, hypers)
        return hypers

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-step; offloads buckets as their gradients become final.
        ``scale_wrt_gas`` (DeepSpeed's name): False when the caller already divided the loss
        by ``grad_accum_steps``. Interrupted, the iteration is rolled back (docs/failure_
        semantics.md)."""
        self.raise_if_failed()
        it, sched = self.scheduler.current, self.scheduler
        micro_steps.check_backward(sched, self.config)
        if it.micro_step == 0:
            self.reconfigurer.apply_pending()
            self.writes.adopt_written()  # weights written since the last step (torch semantics)
        it = self.scheduler.begin_micro_step(self._hypers)
        scale = self.scaler.loss_scale / (self.config.grad_accum_steps if scale_wrt_gas else 1)
        try:
            try:
                sched.in_engine_backward = True  # the gradient hooks tell the user's passes
                with self.telemetry.device_span(LANE_COMPUTE, KIND_BACKWARD,
                                                iteration=self.iteration):
                    (loss * scale if scale != 1.0 else loss).backward()
            finally:
                sched.in_engine_backward = False
                self.weights.end_backward()
            it.losses.append(loss.detach())
            if it.armed:
                sched.launch_remaining()  # buckets some of whose params got no grad
            elif sched.sum_on_host:
                sched.accumulate_remaining()  # this micro-step's gradients all leave
        except BaseException as exc:
            self._interrupted(exc, "backward()")
            raise
        self.raise_if_failed()

    def step(self) -> None:
        """Optimizer step at the end of gradient accumulation (a no-op before it)."""
        self.optimizer.step()

    def _step_impl(self) -> None:
        self.raise_if_failed()
        it = self.scheduler.current
        if 0 < micro_steps.done(self.scheduler) < self.config.grad_accum_steps:
            return  # DeepSpeed semantics: step() every micro-step, acts on the boundary
        try:
            self.weights.end_backward()
            if it.micro_step == 0:  # gradients from a plain loss.backward(): no overlap, no STV
                micro_steps.check_plain_passes(self.scheduler, self.config, "step()")
                self._arm_without_backward()
            n = self.iteration
            finish_iteration(self.scheduler)
        except guard.ContractError:  # the same on every rank: roll the iteration back
            self.scheduler.abort()
            self.synchronize()
            raise
        except BaseException as exc:
            self._interrupted(exc, "step()")
            raise
        self.weights.close_iteration(n)
        now = time.perf_counter()
        self.telemetry.scalar("iteration_s", n, now - self._last_step_end)
        self._last_step_end = now
        self.scheduler.end_iteration()
        self.raise_if_failed()

    def _arm_without_backward(self) -> None:
        self.reconfigurer.apply_pending()
        self.writes.adopt_written()
        self.scheduler.arm_without_backward(self._hypers)
        self.scheduler.current.micro_step = self.config.grad_accum_steps  # armed, like backward

    def _interrupted(self, exc: BaseException, where: str) -> None:
        self.scheduler.recover(exc, where, self.synchronize)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # through the optimizer view, so optimizer.zero_grad() and engine.zero_grad() agree
        self.optimizer.zero_grad(set_to_none)

    def _zero_grad_impl(self, set_to_none: bool = True) -> None:
        it = self.scheduler.current
        if 0 < micro_steps.done(self.scheduler) < self.config.grad_accum_steps:
            return  # mid-accumulation: keep the partial sums
        if it.micro_step:  # after backward, before step(): discard the iteration, as torch
            self.raise_if_failed()  # drops the gradients and its step does nothing
            self.scheduler.abort()
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

    def synchronize(self) -> None:
        """Wait for all in-flight work; then the parameters hold the latest weights."""
        self.raise_if_failed()
        self.scheduler.drain_pending(self.lanes)
        if isinstance(self.telemetry.clock, CudaClock):
            self.telemetry.flush()
            self.telemetry.clock.calibrate()  # the GPU and host clocks drift (ppm)
        self.raise_if_failed()

    def reconfigure(self, **changes: Any) -> None:
        """Thread-safe; applied at the next iteration boundary with a telemetry note."""
        self.reconfigurer.request(changes)

    # ------------------------------------------------------------------ failures, lifetime
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
        guard.release(self.trainable_params(), self)
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
        stuck = None if self.failures.failed else settle(self.lanes)
        if not self.failures.failed and stuck is None:
            with contextlib.suppress(Exception):  # a lane's failure is kept: raised below
                self.scheduler.drain_pending(self.lanes)
        self.closed = True
        self._shut_down()
        self.transport.close()
        self.scheduler.publishes.pending.clear()
        self.scheduler.reset()
        self.state.buffers = []
        if self.failures.failed and not seen:
            self.failures.raise_if_failed()
        if stuck is not None:
            raise WatchdogTimeout(f"close(): {stuck}; abandoned (buckets not finished keep "
                                  "their weights from before the last step)")

    def __enter__(self) -> OffloadEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

