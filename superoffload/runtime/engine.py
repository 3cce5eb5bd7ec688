"""The offload engine (paper §4; DESIGN.md §3): the public facade over one iteration core.

Forward with the device weights (each module waits only for its own bucket's publish);
backward, where a bucket is offloaded the moment its last gradient is final and stepped
speculatively on the CPU; ``step()`` validates, rolls back / replays / skips as the verdict
says, and steps the GPU tail buckets on the device -- the step is the engine's optimizer's, a
``torch.optim.Optimizer`` (runtime/optimizer.py) whose methods ``engine.step`` and its kin
are; an iteration's boundary is runtime/boundary.py's. ``EngineState`` (engine_state.py) books
the parameters and buckets; ``plan.schedule.resolve_schedule`` decides what runs (the planner
calls it too, runtime/build.py); a ``Transport`` moves gradients and weights
(``LocalTransport`` here, FSDP2's in ``superoffload.distributed.fsdp``: the same engine).
``backward()`` and ``step()`` hold the phase order; each phase is a function of the frozen
iteration (runtime/launch.py, runtime/stv.py; the reading order: runtime/__init__.py; the
parts: docs/engine.md). A lane's exception is raised in the caller as an ``EngineError``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from superoffload.config import RECONFIGURABLE, OffloadConfig
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.schedule import Schedule, ScheduleFacts
from superoffload.runtime import build, contract, engine_checkpoint
from superoffload.runtime.boundary import Boundary
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.device_clock import CudaClock
from superoffload.runtime.devices import DeviceOps, make_device_ops
from superoffload.runtime.engine_state import EngineState, InitialStates, ParamState
from superoffload.runtime.errors import EngineClosed, FailureBox
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.iteration import EngineStats, Parts
from superoffload.runtime.lanes import Barrier, Lane, make_lane
from superoffload.runtime.launch import Launcher, check_backward, grad_hooks
from superoffload.runtime.lifetime import close_engine, shut_down, stop_lanes, supersede
from superoffload.runtime.local_transport import LocalTransport
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import defaults_from, param_groups_from
from superoffload.runtime.optimizer import OffloadOptimizer, ToOptimizer
from superoffload.runtime.publishes import Publishes, forward_hooks
from superoffload.runtime.reconfigure import Reconfigurer
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.tier import StateTier
from superoffload.runtime.transfers import InFlight
from superoffload.runtime.transport import Transport, TransportContext
from superoffload.runtime.weight_policy import WeightPolicyController
from superoffload.runtime.weight_writes import WeightWrites
from superoffload.runtime.weightflow import WeightFlow
from superoffload.telemetry.events import KIND_BACKWARD, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder

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
        self.device_ops = device_ops or make_device_ops(config.device, pin_memory=config.pin_memory)
        if self.device_ops.device.type == "cuda":  # device spans on the GPU's clock
            self.telemetry.clock = CudaClock(self.device_ops.device, self.telemetry.now)
        self.failures = FailureBox()
        self.closed = False
        self.closed_why = ""
        groups = param_groups_from(model, optimizer)
        self.state = EngineState.from_model(model, groups)
        self.state.check_placement(self.device_ops.device, config.precision)
        contract.claim_params(self.trainable_params(), self,
                              [self.state.names[i] for i in self.state.trainable])
        self.contract = contract.Contract(self.state)
        self.optimizer = OffloadOptimizer(self, groups, defaults_from(optimizer))  # the step
        self.control = Boundary(self)  # where an iteration begins, how an interrupted one ends
        hypers = self.control.hypers()  # checks the rollback mode against the groups at once
        self.scaler = LossScaler.for_model(config, self.model_dtype)
        self.adaptive = AdaptiveSTV(mode=config.speculation, window=config.adaptive_window,
                                    threshold=config.adaptive_threshold)
        # none of the parts below holds the engine: their futures' callbacks outlive a call
        # on the lane threads and must not keep a dropped engine alive (lifetime.py); what an
        # iteration reads of it is frozen when the iteration begins (frozen.py)
        record = self.failures.record
        self.cpu_worker: Lane = make_lane("cpu_worker", inline=inline, on_error=record)
        self.fetch_lane: Lane = make_lane("fetch", inline=inline, on_error=record)
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
                           cpu_worker=self.cpu_worker, publishes=self.publishes,
                           in_flight=self.in_flight, recorder=self.telemetry, stats=EngineStats())
        start = FrozenIteration(  # what a forward before the first iteration waits with
            number=0, config=self.config, streamed=frozenset(), loss_scale=self.scaler.loss_scale,
            threads=1, speculate=self.adaptive.enabled, accum_on_host=False)
        self.launcher = Launcher(self.parts, self.device_ops, start)
        self.reconfigurer = Reconfigurer(self)
        self.weights = WeightPolicyController(
            self, profile=profile, seq_len=seq_len, micro_batch=micro_batch,
            device_budget_bytes=device_budget_bytes)
        self.writes = WeightWrites(
            state=self.state, contract=self.contract, launcher=self.launcher,
            transport=self.transport, recorder=self.telemetry, weights=self.weights,
            synchronize=self.synchronize)
        self.build_from(InitialStates(self.state.params, self.state.trainable))
        self._core_hooks = grad_hooks(self.launcher) + forward_hooks(
            model, self.publishes, self.launcher, self.weights, self.raise_if_failed)
        self.hooks: list[Any] = list(self._core_hooks)
        self.weights.start()  # weight-flow adds its hooks to self.hooks
        self.hooks += self.writes.register(model)
        # dropped without close(): stop the threads and remove the hooks (the model must not
        # keep a dead engine alive, nor a new engine on it see this one's hooks)
        self.finalizer = weakref.finalize(self, stop_lanes, self.lanes, self.hooks)

    # the optimizer's (runtime/optimizer.py): engine.step() is engine.optimizer.step()
    step, zero_grad, state_dict, load_state_dict = (ToOptimizer() for _ in range(4))
    clip_grad_norm_, grad_norm, full_grad = (ToOptimizer() for _ in range(3))

    # ------------------------------------------------------------------ views
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
    def facts(self) -> ScheduleFacts:
        """What the schedule is resolved from (runtime/build.py ``facts_of``)."""
        return build.facts_of(self)

    def build_from(self, states: Mapping[int, ParamState]) -> None:
        """Resolve the schedule and (re)allocate every bucket from placement-free ``states``."""
        build.build(self, states, self.facts())

    def rebuild(self) -> None:
        """Re-plan the buckets from the current state (after a drain; a weight policy switch)."""
        self.build_from(self.transport.export_states())

    def refresh_schedule(self) -> None:
        build.refresh(self, self.facts())

    def forget_iteration(self) -> None:
        """Forget a partial iteration (after a load or a rebuild)."""
        self.launcher.forget()
        self.publishes.home_ready.clear()

    def new_flow(self, depth: int) -> WeightFlow:
        return WeightFlow(self.model, self.launcher, self.device_ops, self.transport.home, depth,
                          self.fetch_lane)

    # ------------------------------------------------------------------ training API
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
            self.control.at_boundary()
            launcher.begin(self.control.freeze(speculate=self.adaptive.enabled,
                                               accum_on_host=self.accum_on_host))
        # the last micro-step's buckets leave in backward: the hypers they step with are read
        # now, after any scheduler change made between step() and this backward
        last = launcher.current.micro_step + 1 >= self.config.grad_accum_steps
        it = launcher.micro_step(self.control.hypers() if last else None)
        # the loss scale (fp16) times the mean over micro-steps, as DeepSpeed's backward
        scale = it.frozen.loss_scale / (self.config.grad_accum_steps if scale_wrt_gas else 1)
        try:
            try:
                launcher.in_engine_backward = True  # the gradient hooks tell the user's passes
                with self.telemetry.device_span(LANE_COMPUTE, KIND_BACKWARD,
                                                iteration=self.iteration):
                    # scale 1 (fp32, one micro-step): no extra multiply node in the graph
                    (loss * scale if scale != 1.0 else loss).backward()
            finally:
                launcher.in_engine_backward = False
                self.control.end_backward()
            it.losses.append(loss.detach())
            # buckets some of whose params got no gradient never fired their last hook
            if it.armed:
                launcher.launch_remaining()
            # host accumulation: this micro-step's gradients all leave before the next one
            elif it.frozen.accum_on_host:
                launcher.accumulate_remaining()
        except BaseException as exc:
            self.control.interrupted(exc, "backward()")
            raise
        self.raise_if_failed()

    def register_grad_transform(self, fn: Any) -> RemovableHandle:
        """``fn(name, grad) -> Tensor | None`` runs on every gradient when it is final, before
        its bucket leaves (gradient noise, masking, per-parameter scaling...): edit ``grad`` in
        place or return a replacement of the same shape, dtype and device. Returns a handle
        (``.remove()``). The supported way to change gradients: an edit after ``backward()``
        raises (docs/failure_semantics.md). Plain ``loss.backward()`` then ``step()``: applied
        in ``step()``."""
        return self.launcher.register_transform(fn)

    # ------------------------------------------------------------------ state, checkpoints
    def settled(self, what: str) -> None:
        """Checkpoints and state dicts exist only between iterations."""
        self.raise_if_failed()
        # between the last backward() and step(): some buckets stepped with this batch already
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
        self.settled("master_weights()")
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
        self.build_from(states)
        self.contract.tainted = None  # loaded weights are consistent again

    def save_checkpoint(self, path: str, extra: Any = None, *,
                        lr_scheduler: Any = None) -> str:
        """Write ``path/engine.pt`` atomically (runtime/engine_checkpoint.py); returns the file."""
        self.settled("save_checkpoint()")
        return engine_checkpoint.save(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        """Restore everything ``save_checkpoint`` wrote; returns its ``extra``."""
        self.settled("load_checkpoint()")
        return engine_checkpoint.load(self, path, lr_scheduler=lr_scheduler)

    def adopt_model_weights(self) -> None:
        """Make the weights the model holds now the optimizer's (its fp32 masters and host
        copies; the moments stay), as torch's optimizer would simply step from them -- after
        writes the engine refused, or when weights changed in ways it cannot see (a tensor
        subclass, C++ code). Synchronizes; between iterations only."""
        self.settled("adopt_model_weights()")
        self.writes.adopt_all()

    # ------------------------------------------------------------------ lanes, lifetime
    def synchronize(self) -> None:
        """Wait for all in-flight work; then the parameters hold the latest weights."""
        self.raise_if_failed()
        self.drain()
        if isinstance(self.telemetry.clock, CudaClock):
            self.telemetry.flush()
            self.telemetry.clock.calibrate()  # the GPU and host clocks drift (ppm)
        self.raise_if_failed()

    def drain(self) -> None:
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
            why = f" ({self.closed_why})" if self.closed_why else ""
            raise EngineClosed(f"the offload engine is closed{why}; build a new one with "
                               "superoffload.initialize (the model keeps its latest weights)")
        if self.failures.failed:
            shut_down(self)  # a failed engine lets go of the model at once
            self.failures.raise_if_failed()

    @property
    def alive(self) -> bool:
        """Neither closed nor failed (a failed engine has let go of the model)."""
        return not (self.closed or self.failures.failed)

    def close(self) -> None:
        """Drain and stop the lanes, remove the hooks, release the buffers. Idempotent.
        Cleanup always completes; it raises only a lane failure no call has reported yet, or
        a WatchdogTimeout naming a lane stuck for CLOSE_TIMEOUT_S (runtime/lifetime.py)."""
        close_engine(self)

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
        """Another engine took the model (runtime/contract.py ``claim_params``): roll back a half
        iteration, close, and say ``why`` on any later call (runtime/lifetime.py)."""
        supersede(self, why)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "an OffloadEngine cannot be pickled (it holds threads, pinned buffers and hooks on "
            "the model): save it with engine.save_checkpoint(path) and restore with "
            "engine.load_checkpoint(path); the model itself pickles (torch.save(model))")

    def __enter__(self) -> OffloadEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

