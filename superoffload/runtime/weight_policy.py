"""Which weight policy the engine runs, and switching it (paper §4.5).

``OffloadConfig.weights``: "stationary" and "flow" run as asked; "auto" asks
``plan.choose_weights`` with the model's shape (``plan.ModelShape.from_module``), the
micro-batch and sequence length (given to ``initialize``, else read from the first batch the
model sees) and a hardware profile (given, a cached ``measure_local`` profile, or a preset).
The choice, the predicted numbers and the reason go to the log (logger
``superoffload.weights``) and to a telemetry note.

A switch (``engine.reconfigure(weights=..., prefetch_depth=...)``, or "auto" deciding) is
applied at the next forward that starts an iteration: drain every lane, make all weights
resident, re-plan the buckets (weight-flow plans ratio 1 and host-side weight casting), and,
for weight-flow, release the blocks again. Going back to weight-stationary needs every
weight and gradient resident; with ``device_budget_bytes`` set and too small for that, the
switch is refused with a note (the run stays on weight-flow).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulator import choose_weights
from superoffload.plan.storage import TierError, check_homes
from superoffload.plan.weights import WeightChoice
from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.hook_base import in_backward
from superoffload.runtime.launch import Launcher
from superoffload.runtime.weightflow import WeightFlow
from superoffload.telemetry.recorder import Recorder

_log = logging.getLogger("superoffload.weights")


# ------------------------------------------------ which profile "auto" asks the planner with
def default_profile(device_type: str) -> HardwareProfile:
    """The preset "auto" uses when no profile is given: the measured profile of this host if
    one is cached (``plan.measure_local``), else a preset for the device type."""
    from superoffload.plan import profiles

    if device_type == "cpu":
        from superoffload.plan.measure import cached_profile

        # never measures inside initialize()
        hit = cached_profile()
        return hit if hit is not None else profiles.get("cpu-laptop")
    return profiles.get("h200-pcie")


def engine_profile(profile: HardwareProfile | str | None, device_type: str) -> HardwareProfile:
    """A HardwareProfile from an instance, a preset name, "measure" or None (the default)."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is None:
        return default_profile(device_type)
    if profile == "measure":
        from superoffload.plan.measure import measure_local

        return measure_local(quick=True, progress=False)
    if isinstance(profile, str):
        from superoffload.plan import profiles

        return profiles.get(profile)
    raise TypeError(
        f"profile: pass a HardwareProfile, a preset name or 'measure', not {type(profile)}")


class PolicyHost(Protocol):
    """What the controller needs of its engine (runtime/engine.py implements it)."""

    config: OffloadConfig
    telemetry: Recorder
    device_ops: DeviceOps
    launcher: Launcher
    model: torch.nn.Module
    iteration: int
    hooks: list[Any]
    """The engine's hook handles (removed when it closes or is collected)."""

    def synchronize(self) -> None: ...

    def rebuild(self) -> None:
        """Re-plan and re-allocate the buckets, keeping every parameter's state, under the
        policy now active (weight-flow plans ratio 1 and host-side weight casting)."""
        ...

    def new_flow(self, depth: int) -> WeightFlow:
        """A WeightFlow over the engine's model, its iteration and transport homes."""
        ...


class WeightPolicyController:
    """Owns the active weight policy of one engine (see the module docstring)."""

    def __init__(self, engine: PolicyHost, *, profile: HardwareProfile | str | None,
                 seq_len: int | None, micro_batch: int | None,
                 device_budget_bytes: int | None) -> None:
        for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                            ("device_budget_bytes", device_budget_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"initialize({name}={value!r}): use a whole number >= 1 or None")
        # whatever the policy: weight-flow may be switched on later
        try:
            check_homes(engine.config.weight_homes, storage=engine.config.storage_path is not None)
        except TierError as exc:
            raise ConfigError(str(exc)) from None
        self.engine = engine
        self.requested = engine.config.weights
        self.depth = engine.config.prefetch_depth
        self.active = "flow" if self.requested == "flow" else "stationary"
        self.flow: WeightFlow | None = None
        self.choice: WeightChoice | None = None
        self.device_budget_bytes = device_budget_bytes
        self._profile_arg = profile
        self._profile: HardwareProfile | None = None
        self.batch: tuple[int, int] | None = (
            (micro_batch or 1, seq_len) if seq_len is not None else None)
        """(micro-batch, sequence length): given, or read from the first forward's input."""
        self.pending: dict[str, Any] = {}
        """``reconfigure(weights=..., prefetch_depth=...)`` waiting for the next forward."""
        self.fixed_weight_bytes = 0
        """Bytes of the model's weights that never stream (all of them under
        weight-stationary): measured when the policy is set, read at every step's close."""
        # reconfigure() may come from another thread
        self._lock = threading.Lock()
        self._resident_depth = 0
        if self.requested == "auto" and self.batch is not None:
            self.active = self._decide()

    # ------------------------------------------------------------------ engine entry points
    def start(self) -> None:
        """After the engine's first build: stream if flow. The root forward pre-hook
        (runtime/publishes.py) calls ``on_forward`` only while there is work here: the batch
        shape to read (``batch`` None), a switch to apply (``pending``), or weight-flow's
        blocks to stream (``flow``) -- plain attributes it reads on every forward."""
        if self.active == "flow":
            self._attach()
        self._measure_fixed()

    def streamed(self) -> frozenset[int]:
        """Parameter indices weight-flow streams now (empty under weight-stationary)."""
        flow = self.flow
        return flow.streamed_indices if flow is not None else frozenset()

    def request(self, changes: dict[str, Any]) -> None:
        """reconfigure(weights=..., prefetch_depth=...): applied at the next iteration start."""
        with self._lock:
            self.pending.update(changes)

    def _measure_fixed(self) -> None:
        flow = self.flow
        # streamed weights are not fixed on the device: they are counted by the flow's peak
        skip: set[int] = set()
        if flow is not None:
            skip = {id(p) for ps in flow.params for p in ps}
        self.fixed_weight_bytes = sum(p.numel() * p.element_size()
                                      for p in self.engine.model.parameters() if id(p) not in skip)

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """Every streamed block resident inside (a no-op under weight-stationary). Re-entrant:
        only the outermost exit releases (a checkpoint load runs ``model.load_state_dict``,
        whose own hooks ask for resident weights, inside one)."""
        flow = self.flow
        if flow is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def resident() -> Iterator[None]:
            if self._resident_depth == 0:
                self.engine.synchronize()
                flow.materialize()
            self._resident_depth += 1
            try:
                yield
            finally:
                self._resident_depth -= 1
                if self._resident_depth == 0:
                    flow.release_all()

        return resident()

    def activations_on_host(self) -> Any:
        """Wrap a forward in it to keep what autograd saves for backward on the host (pinned
        on CUDA) -- with activation checkpointing, the checkpoints (each block's input) --
        and bring it back in backward: ``torch.autograd.graph.save_on_cpu``. Device memory
        for activations then drops to the recompute of one block; the cost is a D2H + H2D of
        every saved tensor (the option the paper pairs with weight-flow for long sequences)."""
        # on the CPU device ops the "host copy" is a separate CPU tensor: DeviceMeter, whose
        # saved-tensor hooks this inner context replaces, then no longer counts it
        pin = self.engine.device_ops.device.type == "cuda" and self.engine.config.pin_memory
        return torch.autograd.graph.save_on_cpu(pin_memory=pin)

    # ------------------------------------------------------------------ decisions
    def profile(self) -> HardwareProfile:
        if self._profile is None:
            self._profile = engine_profile(self._profile_arg, self.engine.device_ops.device.type)
        return self._profile

    def shape(self) -> ModelShape:
        assert self.batch is not None
        mb, seq = self.batch
        ckpt = bool(getattr(getattr(self.engine.model, "config", None), "checkpointing", False))
        return ModelShape.from_module(self.engine.model, seq=seq, micro_batch=mb,
                                      activation_checkpointing=ckpt)

    def shape_for_planning(self) -> ModelShape:
        """``shape()`` once the batch is known (``seq_len``/``micro_batch``, or the first
        forward); before that the model's own context length at micro-batch 1."""
        if self.batch is not None:
            return self.shape()
        cfg = getattr(self.engine.model, "config", None)
        seq = next((int(v) for k in ("block_size", "max_position_embeddings", "n_positions",
                                     "seq_len") if isinstance(v := getattr(cfg, k, None), int)),
                   2048)
        return ModelShape.from_module(self.engine.model, seq=seq, micro_batch=1)

    def _decide(self) -> str:
        cap = self.device_budget_bytes
        choice = choose_weights(self.shape(), self.profile(),
                                self.engine.config.replace(weights="stationary"),
                                device_memory_bytes=cap)
        self.choice = choice
        text = f"weights='auto' on profile {self.profile().name}: {choice.reason}"
        _log.info(text)
        self.engine.telemetry.note(self.engine.iteration, text)
        return choice.policy

    def on_forward(self, module: torch.nn.Module, args: Any) -> None:
        eng = self.engine
        if eng.launcher.current.micro_step == 0 and not in_backward():
            if self.batch is None and args and isinstance(args[0], torch.Tensor) \
                    and args[0].dim() >= 2:
                self.batch = (int(args[0].shape[0]), int(args[0].shape[1]))
                if self.requested == "auto":
                    with self._lock:
                        self.pending.setdefault("weights", "auto")
            elif self.batch is None and self.requested == "auto":
                raise ValueError(
                    "OffloadConfig.weights='auto' needs the sequence length: the model's first "
                    "argument is not a (batch, seq) tensor; pass initialize(..., seq_len=N)")
            if self.pending:
                self._apply()
        if self.flow is not None and not in_backward():
            self.flow.begin_forward()

    def _apply(self) -> None:
        with self._lock:
            changes, self.pending = self.pending, {}
        eng = self.engine
        old_depth = self.depth
        if "prefetch_depth" in changes:
            self.depth = int(changes["prefetch_depth"])
        if "weights" in changes:
            self.requested = changes["weights"]
        eng.config = eng.config.replace(weights=self.requested, prefetch_depth=self.depth)
        target = self._decide() if self.requested == "auto" else self.requested
        if target == "stationary" and self.active == "flow" and not self._stationary_fits():
            eng.telemetry.note(eng.iteration, "weights: switch to stationary refused, every "
                               f"weight and gradient would not fit device_budget_bytes="
                               f"{self.device_budget_bytes}; staying on weight-flow")
            target = "flow"
        if target == self.active and (target != "flow" or self.depth == old_depth):
            return
        eng.synchronize()
        if self.flow is not None:
            self.flow.detach()
            self.flow = None
        previous, self.active = self.active, target
        eng.rebuild()
        if target == "flow":
            self._attach()
        self._measure_fixed()
        eng.telemetry.note(eng.iteration, f"weights: {previous} -> {target} (prefetch_depth "
                                          f"{self.depth}) from iteration {eng.iteration}")

    def _stationary_fits(self) -> bool:
        if self.device_budget_bytes is None:
            return True
        st = self.engine.launcher.parts.state
        need = 2 * sum(s.numel() for s in st.shapes) * st.model_dtype.itemsize
        return need <= self.device_budget_bytes

    def _attach(self) -> None:
        self.flow = self.engine.new_flow(self.depth)
        self.flow.attach()
        # removed with the engine's (lifetime.py)
        self.engine.hooks.extend(self.flow.handles)
