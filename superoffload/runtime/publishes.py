"""Weights come back: a stepped bucket's publish, the next forward's wait per bucket, and a
write that raced a publish refused (paper §4.2).

After a bucket's CPU step (or its rollback) its new weights are published (H2D, or FSDP2's
shards); a module's forward pre-hook (``WaitWeights``) waits only for its own buckets' last
publish, so the first layers (GPU tail buckets) start at once. A parameter written while its
publish is still in flight raced the copy lane: every write since ``step()`` is discarded and
``WeightsWrittenInFlight`` raised (runtime/contract.py, runtime/weight_writes.py). Weight-flow's
fetches wait for ``home_ready`` (runtime/weightflow.py).

The root module's hooks (``forward_hooks``) open each forward: a failed lane surfaces before
any work, a racing write is refused before any module runs, the forward span goes on the
device's clock, and the weight policy controller (runtime/weight_policy.py) is called only while it
has work (a batch shape to read, a switch to apply, weight-flow). The hooks hold everything
weakly: a dropped engine is collected (runtime/lifetime.py removes them), and a deep copy of
the model (whose hook tables are copied) does nothing on the copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from superoffload.runtime.contract import Contract
from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.hook_base import PicklableHook, eager
from superoffload.runtime.steps import KernelCall, members_of, priority
from superoffload.runtime.transfers import InFlight
from superoffload.runtime.transport import Published, Transport
from superoffload.telemetry.events import KIND_FORWARD, KIND_WAIT, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder


class Publishes:
    """Per bucket, the last publish a module must wait for before it runs."""

    def __init__(self, *, state: EngineState, contract: Contract, device_ops: DeviceOps,
                 recorder: Recorder, transport: Transport, in_flight: InFlight) -> None:
        self.state, self.contract, self.device_ops = state, contract, device_ops
        self.recorder, self.transport, self.in_flight = recorder, transport, in_flight
        self.pending: dict[int, Future[Any]] = {}
        """Per bucket, the device copy of its last publish, until a forward waited for it."""
        self.home_ready: dict[int, Future[Any]] = {}
        """Weight-flow: per bucket, the last step/rollback that wrote its host homes."""
        self.frozen: FrozenIteration | None = None
        """The iteration of the last publish: the watchdog a forward waits with and the
        streamed parameters, as that iteration's work was submitted under them."""

    def publish(self, b: int, calls: tuple[KernelCall, ...], after: Future[Any],
                frozen: FrozenIteration) -> Published:
        """Bring bucket ``b``'s weights back after ``after`` (a step or a rollback), in the
        worker's deadline order (``steps.priority``); returns what it started."""
        pub = self.transport.publish(b, tuple(members_of(calls)), after, frozen,
                                     priority(b, frozen))
        self.frozen = frozen
        if pub.device is not None:
            self.pending[b] = pub.device
            self.in_flight.add(pub.device)
        if pub.home is not None:
            self.home_ready[b] = pub.home
        return pub

    def wait_for_weights(self, indices: Iterable[int], iteration: int) -> None:
        """Forward pre-hook of a module: its own buckets' last publish, nothing else (§4.2).
        A parameter written while that publish was in flight raced the copy lane: the write is
        discarded (the published weights restored) and ``WeightsWrittenInFlight`` raised.
        ``iteration``: the one the forward belongs to (telemetry)."""
        bucket_of = self.state.bucket_of
        buckets = {bucket_of[i] for i in indices if i in bucket_of}
        for b in sorted(buckets):
            fut = self.pending.pop(b, None)
            if fut is None:
                continue
            frozen = self.frozen
            assert frozen is not None, "a pending publish records its iteration"
            if self.contract.written([i for i in indices if bucket_of.get(i) == b],
                                     frozen.streamed):  # a write inside the forward itself
                self.pending[b] = fut
                # every bucket still in flight, then raise
                self.discard_racing_writes()
            t0 = self.recorder.now()
            self.device_ops.wait(self.in_flight.wait(fut, f"{self.transport.name} publish of "
                                                       f"bucket {b}", frozen.config.watchdog_s))
            self.recorder.add(LANE_COMPUTE, KIND_WAIT, t0, self.recorder.now(),
                              iteration=iteration, bucket=b)

    def discard_racing_writes(self) -> None:
        """Wait for every publish still in flight (from the training thread's view: not yet
        waited for by a forward or a synchronize). If a parameter of those buckets was written
        meanwhile, the write raced the copy lane, whatever the timing: every write since
        ``step()`` is discarded (the published weights restored, so no mix of written and
        published buckets) and ``WeightsWrittenInFlight`` raised (runtime/weight_writes.py)."""
        bucket_of, pending, frozen = self.state.bucket_of, dict(self.pending), self.frozen
        # nothing in flight: no write can have raced a publish
        written = []
        if pending and frozen is not None:
            written = self.contract.written(self.state.trainable, frozen.streamed)
        racing = [i for i in written if bucket_of.get(i) in pending]
        for b, fut in pending.items():
            assert frozen is not None, "a pending publish records its iteration"
            self.device_ops.wait(self.in_flight.wait(fut, f"{self.transport.name} publish of "
                                                       f"bucket {b}", frozen.config.watchdog_s))
            self.pending.pop(b, None)
        self.device_ops.synchronize()
        if racing:
            lost = self.transport.restore(written) or []
            self.contract.rebase(written)
            raise self.contract.in_flight_error(racing, lost)

    def check_writes_before_forward(self) -> None:
        """Root forward pre-hook: a write racing an in-flight publish is refused before any
        module runs (``discard_racing_writes``); other writes wait for the next iteration's
        adoption."""
        if not self.pending or self.frozen is None:
            return
        bucket_of = self.state.bucket_of
        if any(bucket_of.get(i) in self.pending
               for i in self.contract.written(self.state.trainable, self.frozen.streamed)):
            self.discard_racing_writes()


# ---------------------------------------------------------------------------- the hooks
class Clock(Protocol):
    """The iteration a forward belongs to (runtime/launch.py ``Launcher``)."""

    iteration: int


class ForwardWork(Protocol):
    """What the root pre-hook reads of the weight policy controller (runtime/weight_policy.py):
    plain attributes, so a forward with nothing to do there calls nothing."""

    batch: tuple[int, int] | None
    pending: dict[str, Any]
    flow: Any

    def on_forward(self, module: torch.nn.Module, args: Any) -> None: ...


def forward_hooks(model: torch.nn.Module, publishes: Publishes, clock: Clock,
                  weights: ForwardWork, raise_if_failed: Callable[[], None]) -> list[Any]:
    """A ``WaitWeights`` pre-hook on every module owning trainable parameters and the root's
    ``Timeline`` (handles: ``.remove()`` on close)."""
    st, pub, ref = publishes.state, weakref.ref(publishes), weakref.ref(clock)
    handles: list[Any] = []
    for module in model.modules():
        own = tuple(st.index[id(p)] for p in module.parameters(recurse=False)
                    if id(p) in st.index and st.index[id(p)] in st.bucket_of)
        if own:
            handles.append(module.register_forward_pre_hook(
                WaitWeights(pub, ref, weakref.ref(module), own)))
    timeline = Timeline(pub, ref, weakref.ref(model), weakref.ref(weights),
                        weakref.WeakMethod(raise_if_failed))  # type: ignore[arg-type]
    handles += [model.register_forward_pre_hook(timeline.start),
                model.register_forward_hook(timeline.end)]
    return handles


class WaitWeights(PicklableHook):
    """Forward pre-hook of a module owning parameters: wait for its own buckets' publish."""

    def __init__(self, pub: weakref.ref[Publishes], clock: weakref.ref[Clock],
                 owner: weakref.ref[torch.nn.Module], indices: tuple[int, ...]) -> None:
        self.pub, self.clock, self.owner, self.indices = pub, clock, owner, indices

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        publishes, clock = self.pub(), self.clock()
        if publishes is not None and clock is not None and module is self.owner():
            publishes.wait_for_weights(self.indices, clock.iteration)


class Timeline(PicklableHook):
    """The root module's forward: a failed lane surfacing before any work, a racing write
    refused, the weight policy's work, and the forward span on the device's clock."""

    def __init__(self, pub: weakref.ref[Publishes], clock: weakref.ref[Clock],
                 owner: weakref.ref[torch.nn.Module], weights: weakref.ref[ForwardWork],
                 check: weakref.WeakMethod[Any]) -> None:
        self.pub, self.clock, self.owner, self.weights, self.check = \
            pub, clock, owner, weights, check
        self.starts: list[float] = []
        self.start = _Bound(self, True)
        self.end = _Bound(self, False)

    def on_start(self, module: torch.nn.Module, args: Any) -> None:
        publishes = self.pub()
        if publishes is None or module is not self.owner():
            return
        # the engine lets go of the model and raises
        if publishes.in_flight.failures.failed:
            raise_if_failed = self.check()
            if raise_if_failed is not None:
                raise_if_failed()
        publishes.check_writes_before_forward()  # a racing write, before any module
        if torch.is_grad_enabled():  # evaluation forwards stay out of the training timeline
            self.starts.append(publishes.recorder.mark())  # the device's clock (recorder.py)
        work = self.weights()
        if work is not None and (work.batch is None or work.pending or work.flow is not None):
            work.on_forward(module, args)

    def on_end(self, module: torch.nn.Module) -> None:
        publishes, clock = self.pub(), self.clock()
        if publishes is None or clock is None or module is not self.owner() \
                or not torch.is_grad_enabled():
            return
        end = publishes.recorder.mark()
        publishes.recorder.add_marks(LANE_COMPUTE, KIND_FORWARD,
                                     self.starts.pop() if self.starts else end, end,
                                     iteration=clock.iteration)


class _Bound(PicklableHook):
    """``Timeline``'s pre-hook (``start``) or post-hook (``end``)."""

    def __init__(self, timeline: Timeline, start: bool) -> None:
        self.timeline, self.is_start = timeline, start

    @eager
    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if self.is_start:
            self.timeline.on_start(module, args[0] if args else ())
        else:
            self.timeline.on_end(module)
