"""Weights written outside the engine: torch's semantics, or an error
(docs/failure_semantics.md, "What you may do with the engine").

With a ``torch.optim`` optimizer, ``model.load_state_dict(best)`` (restoring an EMA or the best
model) or ``p.mul_(0.5)`` under ``no_grad`` between steps simply changes the weights the next
step starts from; the moments carry on. The engine keeps fp32 masters on the host (and, for a
bf16 model, a bf16 copy there), so it must notice such a write and adopt it, or the next step
of an offloaded bucket would start from the old master and undo it while a GPU tail bucket
kept it (half one way, half the other). runtime/contract.py holds the detection (version
counters); this module acts on it:

* at the start of each iteration (the first ``backward()``, or ``step()`` after a plain
  ``loss.backward()``) every written trainable parameter is adopted: its master (this rank's
  shard under ZeRO) and host low-precision copy become the written values; a note says so;
* a write made while the parameter's new weights were still being published (after
  ``step()``, before the forward that waits for them or ``synchronize()``) raced the copy
  lane: the forward pre-hook (``Publishes.wait_for_weights``) or this adoption
  discards it and raises ``WeightsWrittenInFlight`` -- deterministic, whatever the timing;
* ``model.load_state_dict`` is made safe and exact by hooks on the model: it first waits for
  every publish (and under weight-flow materializes the streamed blocks, whose parameters are
  otherwise released to 0 elements), and adopts what it wrote at once;
* ``model.state_dict()`` under weight-flow returns full weights (gathered from the host homes,
  cloned: the device buffers are reused), not the released 0-element parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from superoffload.runtime.contract import Contract, ContractError
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.hook_base import PicklableHook
from superoffload.runtime.launch import Launcher
from superoffload.runtime.transport import Transport
from superoffload.runtime.weight_policy import WeightPolicyController
from superoffload.telemetry.recorder import Recorder


class WeightWrites:
    """Adopts weights written outside the engine (see the module docstring)."""

    def __init__(self, *, state: EngineState, contract: Contract, launcher: Launcher,
                 transport: Transport, recorder: Recorder, weights: WeightPolicyController,
                 synchronize: Callable[[], None]) -> None:
        self.state, self.contract, self.launcher = state, contract, launcher
        self.transport, self.recorder, self.weights = transport, recorder, weights
        self.synchronize = synchronize
        self._resident: Any = None
        """The resident-weights context a load/save of the model's state dict holds open."""

    def adopt_written(self, *, where: str = "") -> list[int]:
        """Adopt every trainable parameter written since the engine last wrote it; raise for a
        write that raced an in-flight publish. Returns the adopted indices."""
        self.contract.check_tainted()
        streamed = self.weights.streamed()
        written = self.contract.written(self.state.trainable, streamed)
        if not written:
            return []
        released = [i for i in written if i in streamed and self.state.params[i].numel() == 0]
        if released:
            self.contract.rebase(released)
            names = ", ".join(repr(self.state.names[i]) for i in released[:3])
            raise ContractError(
                f"parameter(s) {names} were written while weight-flow had released them (0 "
                "elements outside their block's forward); the write changed nothing. Write "
                "streamed weights inside `with engine.resident_weights():` or with "
                "model.load_state_dict(...), which makes them resident first")
        publishes = self.launcher.parts.publishes
        if any(self.state.bucket_of.get(i) in publishes.pending for i in written):
            # a write that raced a publish in flight: discarded, and this raises, naming it
            publishes.discard_racing_writes()
        self.transport.adopt(written)
        self.contract.rebase(written)
        self.recorder.note(self.launcher.iteration, (
            f"{len(written)} parameter(s) written outside the engine{where} (e.g. "
            f"{self.state.names[written[0]]!r}): the optimizer continues from the written "
            "weights with its moments"))
        return written

    # ------------------------------------------------------------------ model hooks
    def register(self, model: torch.nn.Module) -> list[Any]:
        """load_state_dict / state_dict hooks on the root module (handles: ``.remove()``)."""
        ref = weakref.ref(self)
        return [model.register_load_state_dict_pre_hook(_LoadPre(ref)),
                model.register_load_state_dict_post_hook(_LoadPost(ref)),
                model.register_state_dict_pre_hook(_SavePre(ref)),
                model.register_state_dict_post_hook(_SavePost(ref))]

    def before_load(self) -> None:
        # no publish in flight: the load cannot race a copy lane
        self.synchronize()
        self._open_resident()

    def after_load(self) -> None:
        try:
            # consistent weights again: the user's choice
            self.contract.tainted = None
            self.adopt_written(where=" by load_state_dict")
        finally:
            self._close_resident()

    def adopt_all(self) -> None:
        """``engine.adopt_model_weights()``: the weights the model holds now become the
        optimizer's (masters, host copies), whatever wrote them; clears a mix left by a
        refused racing write."""
        self.synchronize()
        with self.weights.resident():
            streamed = self.weights.streamed()
            live = [i for i in self.state.trainable
                    if i not in streamed or self.state.params[i].numel()]
            self.transport.adopt(live)
            self.contract.rebase(live)
        self.contract.tainted = None

    def before_save(self) -> None:
        # the weights step() published, not those still in flight
        self.synchronize()
        self._open_resident()

    def after_save(self, state_dict: dict[str, Any], prefix: str) -> None:
        if self._resident is None:
            return
        # full weights that outlive the resident blocks (their buffers are reused)
        try:
            streamed = self.weights.streamed()
            names = {prefix + self.state.names[i] for i in streamed}
            for key in list(state_dict):
                if key in names and isinstance(state_dict[key], torch.Tensor):
                    state_dict[key] = state_dict[key].clone()
        finally:
            self._close_resident()

    def _open_resident(self) -> None:
        if self.weights.flow is not None and self._resident is None:
            # re-entrant: inside resident_weights() a no-op
            ctx = self.weights.resident()
            ctx.__enter__()
            self._resident = ctx

    def _close_resident(self) -> None:
        ctx, self._resident = self._resident, None
        if ctx is not None:
            ctx.__exit__(None, None, None)


class _Hook(PicklableHook):
    """A model hook holding the engine's ``WeightWrites`` weakly (runtime/hook_base.py)."""

    def __init__(self, ref: weakref.ref[WeightWrites]) -> None:
        self.ref = ref


class _LoadPre(_Hook):
    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        w = self.ref()
        if w is not None and module is w.state.model:
            w.before_load()


class _LoadPost(_Hook):
    def __call__(self, module: torch.nn.Module, incompatible: Any) -> None:
        w = self.ref()
        if w is not None and module is w.state.model:
            w.after_load()


class _SavePre(_Hook):
    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        w = self.ref()
        if w is not None and module is w.state.model and not prefix:
            w.before_save()


class _SavePost(_Hook):
    def __call__(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
        w = self.ref()
        if w is not None and module is w.state.model and not prefix:
            w.after_save(state_dict, prefix)
