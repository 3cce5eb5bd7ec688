"""The offload engine (paper §4; DESIGN.md §3), weight-stationary or weight-flow (§4.5).

One iteration: forward with the device weights (each module waits only for its own
bucket's H2D); backward, where a bucket is offloaded the moment its last gradient is final
(post-accumulate-grad hooks) and the CPU worker steps it speculatively; then ``step()``
validates (global norm, inf/nan), rolls back / replays / skips as the verdict says
(``runtime/iteration.py``), and steps the GPU tail buckets on the device. Under weight-flow
the blocks' weights stream in per block (``runtime/weightflow.py``); ``runtime/weights.py``
chooses and switches the policy.

Threads: the training thread owns all bookkeeping; the D2H lane, the CPU worker and the H2D
lane only run frozen tasks (``runtime/worker.py``). An exception on a lane is stored and
raised in the training thread at its next call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.plan.buckets import BucketPlan, ParamSpec, plan_buckets
from superoffload.plan.profiles import HardwareProfile
from superoffload.runtime import hooks as _hooks
from superoffload.runtime import iteration as _iter
from superoffload.runtime.backend import Backend, make_backend
from superoffload.runtime.casting import CastPolicy, resolve_casting
from superoffload.runtime.lifetime import EngineLifetime
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.optim_view import EngineOptimizer, param_groups_from
from superoffload.runtime.state import (
    BucketBuffers,
    ParamState,
    build_buffers,
    export_state,
    initial_state,
)
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.transfers import wait_for
from superoffload.runtime.weights import WeightPolicyController
from superoffload.runtime.worker import Lane, describe, make_lane
from superoffload.telemetry.events import KIND_BACKWARD, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder

RECONFIGURABLE = frozenset({
    "ratio", "bucket_bytes", "speculation", "grad_cast", "param_cast", "cpu_threads",
    "max_grad_norm", "rollback", "adaptive_window", "adaptive_threshold", "watchdog_s",
    "weights", "prefetch_depth",
})
_WEIGHT_KEYS = frozenset({"weights", "prefetch_depth"})
_REPLAN_KEYS = frozenset({"ratio", "bucket_bytes", "grad_cast", "param_cast"})


class EngineError(RuntimeError):
    """A failure on one of the engine's lanes, raised in the training thread."""


@dataclass(slots=True)
class EngineStats:
    """Counters of what happened (bucket counts are per bucket, not per iteration)."""

    iterations: int = 0
    skipped_steps: int = 0
    clipped_steps: int = 0
    rollbacks: int = 0
    """Speculative bucket steps undone."""
    replays: int = 0
    """Bucket steps replayed with the clipped gradient."""
    speculated_buckets: int = 0
    """Speculative bucket steps that ran."""
    nonfinite_buckets: int = 0
    """Buckets whose own gradient was non-finite (never speculated)."""
    speculation_enabled: bool = True
    reconfigurations: int = 0


@dataclass(slots=True)
class _Mutable:
    """Per-iteration bookkeeping of the training thread."""

    micro_step: int = 0
    armed: bool = False
    speculate: bool = False
    fired: dict[int, set[int]] = field(default_factory=dict)
    flights: dict[int, _iter.Flight] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


class OffloadEngine(EngineLifetime):
    """See module docstring. Build with ``superoffload.initialize``."""

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
    ) -> None:
        """``profile``, ``seq_len``, ``micro_batch``: what weights="auto" asks the planner with
        (runtime/weights.py); ``device_budget_bytes``: the device memory that choice and a
        switch back to weight-stationary may assume (a cap; tests use it on the CPU)."""
        self.config = config.validate()
        self.model = model
        self.telemetry = telemetry or Recorder(
            enabled=config.telemetry, max_events=config.telemetry_max_events
        )
        self.backend = backend or make_backend(config.device, pin_memory=config.pin_memory)
        self.iteration = 0
        self.stats = EngineStats()
        self._closed = False
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._reconf_lock = threading.Lock()
        self._pending_changes: dict[str, Any] = {}
        self._hook_lock = threading.Lock()

        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._params: list[torch.nn.Parameter] = [p for _, p in named]
        self._shapes = [p.shape for p in self._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        dev = self.backend.device
        for p in self._params:
            if p.device.type != dev.type or (dev.type == "cuda" and p.device.index != dev.index):
                raise ValueError(
                    f"model parameters are on {p.device} but OffloadConfig.device resolves to "
                    f"{self.backend.device}; move the model first (model.to(...))"
                )
        groups = param_groups_from(model, optimizer)
        self._group_of: dict[int, int] = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if id(p) not in self._index:
                    raise ValueError(f"optimizer[{g}]: a parameter does not belong to the model")
                self._group_of[self._index[id(p)]] = g
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad and i in self._group_of]
        if not trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {self._params[i].dtype for i in trainable}
        if len(dtypes) != 1:
            raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; use one")
        self.model_dtype = dtypes.pop()
        self._trainable = trainable
        self._steps = [0] * len(self._params)
        self.optimizer = EngineOptimizer(
            groups, step_fn=self._step_impl, zero_grad_fn=self._zero_grad_impl,
            state_fn=self.state_dict, load_fn=self.load_state_dict,
        )
        self.scaler = LossScaler.for_model(config, self.model_dtype)
        self.adaptive = AdaptiveSTV(mode=config.speculation, window=config.adaptive_window,
                                    threshold=config.adaptive_threshold)
        self._lanes: list[Lane] = [
            make_lane(n, inline=inline, on_error=self._on_lane_error)
            for n in ("d2h", "cpu_worker", "h2d")
        ]
        self.d2h_lane, self.worker, self.h2d_lane = self._lanes
        # weight-flow fetches: their own thread, the H2D stream on CUDA (runtime/weightflow.py)
        self.fetch_lane = make_lane("fetch", inline=inline, on_error=self._on_lane_error)
        self._lanes.append(self.fetch_lane)
        self._h2d_pending: dict[int, Future[Any]] = {}
        self._home_ready: dict[int, Future[Any]] = {}
        """Weight-flow: per bucket, the last CPU step/rollback that wrote its host weights."""
        self._it = _Mutable()
        self._last_step_end = time.perf_counter()
        self.weights = WeightPolicyController(
            self, profile=profile, seq_len=seq_len, micro_batch=micro_batch,
            device_budget_bytes=device_budget_bytes)
        self._build(self.config, [initial_state(self._params[i]) for i in trainable])
        self._hooks = _hooks.register(self)
        self._hooks += self.weights.start()

    # ------------------------------------------------------------------ setup
    def _build(self, config: OffloadConfig, states: Sequence[ParamState]) -> None:
        """(Re)plan buckets and allocate their buffers from placement-free ``states``.
        Weight-flow plans every bucket on the host with host-side weight casting (§4.5)."""
        flow = self.weights.active == "flow"
        self.cast: CastPolicy = resolve_casting(
            config.grad_cast, "host" if flow else config.param_cast, model_dtype=self.model_dtype,
            device_type=self.backend.device.type,
        )
        specs = [ParamSpec(i, self._params[i].numel(), True, self._names[i]) for i in self._trainable]
        self.bucket_plan: BucketPlan = plan_buckets(specs, bucket_bytes=config.bucket_bytes,
                                                    ratio=1.0 if flow else config.ratio)
        self._home_ready.clear()
        by_index = dict(zip(self._trainable, states))
        self._buffers: list[BucketBuffers] = []
        self._bucket_of: dict[int, tuple[int, int]] = {}
        for bucket in self.bucket_plan.buckets:
            params = [self._params[i] for i in bucket.param_indices]
            self._buffers.append(build_buffers(
                bucket, params, [by_index[i] for i in bucket.param_indices],
                alloc_host=self.backend.alloc_host, alloc_device=self.backend.alloc_device,
                grad_host_dtype=self.cast.grad_host_dtype,
                lp_host=self.cast.low_precision and self.cast.param_on_host,
            ))
            for pos, i in enumerate(bucket.param_indices):
                self._bucket_of[i] = (bucket.id, pos)
                self._steps[i] = by_index[i].step
        self.threads = config.cpu_threads or _iter.default_threads(config.cpu_cores_frac)

    def _reset_iteration(self) -> None:
        """Forget a partial iteration (a load mid-accumulation starts a fresh one)."""
        self._it = _Mutable()

    def _launch(self, b: int) -> None:
        self._it.flights[b] = _iter.launch_bucket(self, b)

    # ------------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step; offloads buckets as their gradients become final."""
        self._raise_if_failed()
        it = self._it
        if it.micro_step == 0:
            self._apply_pending()
            it.speculate = self.adaptive.enabled
            self.stats.speculation_enabled = self.adaptive.enabled
        it.micro_step += 1
        it.armed = it.micro_step >= self.config.grad_accum_steps
        t0 = self.telemetry.now()
        scale = self.scaler.loss_scale / self.config.grad_accum_steps
        try:
            (loss * scale if scale != 1.0 else loss).backward()
        finally:
            self.telemetry.add(LANE_COMPUTE, KIND_BACKWARD, t0, self.telemetry.now(),
                               iteration=self.iteration)
            self.weights.end_backward()
        it.losses.append(float(loss.detach()))
        if it.armed:
            for b in range(len(self._buffers)):  # buckets some of whose params got no grad
                with self._hook_lock:
                    todo = b not in it.flights
                    if todo:
                        it.flights[b] = _iter.Flight.placeholder(b)
                if todo:
                    self._launch(b)
        self._raise_if_failed()

    def step(self) -> None:
        """Optimizer step at the end of gradient accumulation (a no-op before it)."""
        self.optimizer.step()

    def _step_impl(self) -> None:
        self._raise_if_failed()
        it = self._it
        if 0 < it.micro_step < self.config.grad_accum_steps:
            return  # DeepSpeed semantics: step() every micro-step, acts on the boundary
        self.weights.end_backward()
        if it.micro_step == 0:  # gradients from a plain loss.backward(): no overlap, no STV
            self._apply_pending()
            it.speculate = False
            it.armed = True
            for b in range(len(self._buffers)):
                it.flights[b] = _iter.Flight.placeholder(b)
                self._launch(b)
        n = self.iteration
        _iter.finish_iteration(self)
        self.weights.close_iteration(n)
        now = time.perf_counter()
        self.telemetry.scalar("iteration_s", self.iteration - 1, now - self._last_step_end)
        self._last_step_end = now
        self._it = _Mutable()
        self._raise_if_failed()

    def synchronize(self) -> None:
        """Wait for all in-flight work; then the parameters hold the latest weights."""
        self._raise_if_failed()
        for lane in self._lanes:
            barrier = lane.submit(_iter.Barrier())
            try:
                wait_for(barrier, self.config.watchdog_s, "synchronize")
            except Exception as exc:
                self._raise_if_failed()
                raise type(exc)(f"{describe(lane)}: {exc}") from exc
        for b, fut in list(self._h2d_pending.items()):
            self.backend.wait(self._wait(fut, f"H2D of bucket {b}"))
        self._h2d_pending.clear()
        self.backend.synchronize()
        self._raise_if_failed()

    # ------------------------------------------------------------------ reconfigure
    def reconfigure(self, **changes: Any) -> None:
        """Thread-safe; applied at the next iteration boundary with a telemetry note."""
        for key in changes:
            if key not in RECONFIGURABLE:
                raise ConfigError(
                    f"reconfigure({key}=...): not changeable while training; changeable: "
                    f"{', '.join(sorted(RECONFIGURABLE))}"
                )
        with self._reconf_lock:
            merged = {**self._pending_changes, **changes}
            self.config.replace(**merged)  # validate now, in the caller's thread
            weight_changes = {k: merged.pop(k) for k in _WEIGHT_KEYS & merged.keys()}
            self._pending_changes = merged
        if weight_changes:
            # applied where an iteration's forward starts, not at its backward (weights.py)
            self.weights.request(weight_changes)

    def _apply_pending(self) -> None:
        with self._reconf_lock:
            changes, self._pending_changes = self._pending_changes, {}
        if not changes:
            return
        old = self.config
        new = old.replace(**changes)
        if _REPLAN_KEYS & changes.keys():
            self.synchronize()
            states = self._export_states()
            self.config = new
            self._build(new, [states[i] for i in self._trainable])
        self.config = new
        self.threads = new.cpu_threads or _iter.default_threads(new.cpu_cores_frac)
        self.adaptive.configure(mode=new.speculation, window=new.adaptive_window,
                                threshold=new.adaptive_threshold)
        self.stats.reconfigurations += 1
        diff = ", ".join(f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in sorted(changes))
        self.telemetry.note(self.iteration, f"reconfigure applied: {diff}")

    # ------------------------------------------------------------------ state
    def _export_states(self) -> dict[int, ParamState]:
        out: dict[int, ParamState] = {}
        for buf in self._buffers:
            steps = [self._steps[i] for i in buf.bucket.param_indices]
            out.update(zip(buf.bucket.param_indices, export_state(buf, steps)))
        return out

    def resident_weights(self) -> contextlib.AbstractContextManager[None]:
        """Within it every streamed block is resident (weight-flow; a no-op otherwise):
        model.state_dict() / load_state_dict() see the real weights (checkpoints)."""
        flow = self.weights.flow
        if flow is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def resident() -> Iterator[None]:
            self.synchronize()
            flow.materialize()
            try:
                yield
            finally:
                flow.release_all()

        return resident()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weight of every trainable parameter (CPU copies), after synchronizing."""
        self.synchronize()
        return {self._names[i]: s.master for i, s in self._export_states().items()}

    def state_dict(self) -> dict[str, Any]:
        from superoffload.runtime import checkpoint

        return checkpoint.engine_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from superoffload.runtime import checkpoint

        checkpoint.load_engine_state_dict(self, state_dict)

    def save_checkpoint(self, path: str, extra: Any = None, *, lr_scheduler: Any = None) -> str:
        from superoffload.runtime import checkpoint

        return checkpoint.save(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        from superoffload.runtime import checkpoint

        return checkpoint.load(self, path, lr_scheduler=lr_scheduler)

    # ------------------------------------------------------------------ failures, lifetime
    def _on_lane_error(self, lane: str, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = exc
                self._error_lane = lane

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError("the offload engine is closed")
        if self._error is not None:
            raise EngineError(
                f"the engine's {self._error_lane} lane failed: {self._error!r}"
            ) from self._error

    def close(self) -> None:
        """Drain and stop the lanes, remove hooks, release buffers. Idempotent."""
        if self._closed:
            return
        flow = self.weights.flow
        if flow is not None and self._error is None:
            # weight-flow: leave the model holding its latest weights, as stationary does
            try:
                self.synchronize()
                flow.detach()
            except Exception:  # closing must not raise; a failed lane was reported already
                pass
        self._closed = True
        for lane in self._lanes:
            lane.close()
        self.weights.flow = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._h2d_pending.clear()
        self._it = _Mutable()
        self._buffers = []

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass


def initialize(
    model: torch.nn.Module,
    optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    config: OffloadConfig | Mapping[str, Any] | None = None,
    telemetry: Recorder | None = None,
    **kwargs: Any,
) -> OffloadEngine:
    """Build an engine. ``config`` may be an OffloadConfig or a DeepSpeed-style dict, whose
    optimizer section fills in hyperparameters not given in ``optimizer``."""
    if config is None:
        config = OffloadConfig()
    elif isinstance(config, Mapping):
        from superoffload.ds_config import from_deepspeed

        config, ds_opt = from_deepspeed(dict(config))
        _check_precision(model, config.extra["deepspeed_precision"])
        if optimizer is None:
            optimizer = ds_opt
        elif isinstance(optimizer, Mapping):
            optimizer = {**ds_opt, **optimizer}
    elif not isinstance(config, OffloadConfig):
        raise TypeError(f"config: pass an OffloadConfig or a DeepSpeed-style dict, not {type(config)}")
    return OffloadEngine(model, optimizer, config, telemetry, **kwargs)


def _check_precision(model: torch.nn.Module, precision: str) -> None:
    expect = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    have = {p.dtype for p in model.parameters() if p.requires_grad}
    if have and have != {expect}:
        raise ConfigError(
            f"the DeepSpeed config trains in {precision} (bf16.enabled / fp16.enabled) but the "
            f"model's trainable parameters are {sorted(map(str, have))}; cast the model first, "
            f"e.g. model.to({expect})"
        )
