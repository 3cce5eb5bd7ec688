"""Gradients leave the device with their bucket (paper §4.2; DESIGN.md §3 step 2).

When a host bucket's gradients are final, the transport starts moving them (D2H, or a
reduce under data parallel) and the device copies are freed: ``p.grad`` becomes None, as
under DeepSpeed ZeRO-2, and the memory returns once the copy has landed (the D2H task holds
the tensors until then; on CUDA ``record_stream`` keeps the allocator from reusing them
early). So the device holds the weights, the GPU tail's gradients and state, and at most
``OffloadConfig.grad_buckets_in_flight`` offloaded buckets' gradients whose copy has not
landed, plus the bucket backward is filling: when the bound is reached, backward waits for
the oldest copy (the planner charges the same, plan/memory.py). ``keep_device_grads`` keeps
them (weight-flow's streamed gradients leave regardless: their weights are not resident).

Gradient accumulation (``grad_accum_steps`` > 1) has two places to sum:

* "device": gradients sum in ``p.grad`` until the last micro-step, then leave once (the
  offloaded buckets' full gradients are resident meanwhile; one D2H per optimizer step);
* "host": every micro-step's gradients leave with their bucket and are summed into the
  bucket's fp32 host buffer (ZeRO-Offload's CPU-side accumulation): one D2H per micro-step,
  the device bound above holds throughout. The first micro-step that gives a parameter a
  gradient starts its sum (a copy), later ones add; the last one's statistics are read from
  the summed host buffer (``D2HTask.stats_host``). A bucket whose gradients are kept
  (``keep_device_grads``) sums in ``.grad`` as under "device" (autograd and FSDP2 add into a
  kept gradient, so each micro-step's ``.grad`` already holds the earlier ones: adding it on
  the host would count them again) and leaves once, at the last micro-step.

``Departures`` decides this when a bucket launches; the transport moves the data.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from superoffload.runtime.devices import PendingStats
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.transfers import InFlight
from superoffload.runtime.transport import Transport


class Departures:
    """Per engine: the host buckets' gradients in flight, the host sums, what is freed. Every
    decision reads the iteration's settings (``frozen``): the bound
    (``grad_buckets_in_flight``), whether gradients are kept (``keep_device_grads``), where
    they accumulate (``accum_on_host``), weight-flow's streamed parameters."""

    def __init__(self, state: EngineState, transport: Transport, in_flight: InFlight) -> None:
        self.state, self.transport, self.waits = state, transport, in_flight
        self.in_flight: deque[tuple[int, Future[Any]]] = deque()
        """Host buckets whose gradients were freed and whose copy may not have landed yet,
        oldest first (their futures resolve once it has)."""
        self.sums: dict[int, set[int]] = {}
        """Host accumulation: per bucket, the parameters whose host buffer holds a partial
        sum from an earlier micro-step of this optimizer step."""

    def reset(self) -> None:
        """Forget the host sums and the in-flight list (an aborted iteration: the next first
        micro-step restarts every sum; the lanes are drained by the caller)."""
        self.in_flight.clear()
        self.sums.clear()

    # ------------------------------------------------------------------ queries
    def frees(self, b: int, frozen: FrozenIteration) -> bool:
        """Whether bucket ``b``'s device gradients are freed once they leave."""
        if self.state.buffers[b].on_device:
            # the tail steps on the device from them
            return False
        return not frozen.config.keep_device_grads or any(
            i in frozen.streamed for i in self._members(b))

    def sums_on_host(self, b: int, frozen: FrozenIteration) -> bool:
        """Whether bucket ``b``'s micro-steps are summed on the host: host accumulation of
        an offloaded bucket whose device gradients are freed as they leave (a kept one sums
        in ``.grad``, the module docstring)."""
        return frozen.accum_on_host and self.frees(b, frozen)

    def summed(self, b: int) -> frozenset[int]:
        """Parameters of ``b`` with a host partial sum (host accumulation)."""
        return frozenset(self.sums.get(b, ()))

    def moving(self, b: int) -> tuple[int, ...]:
        """Parameters of ``b`` holding a device gradient now."""
        params = self.state.params
        return tuple(i for i in self._members(b) if params[i].grad is not None)

    def _members(self, b: int) -> tuple[int, ...]:
        schedule = self.state.schedule
        assert schedule is not None, "the engine builds its buckets before training"
        return schedule.bucket_plan.buckets[b].param_indices

    # ------------------------------------------------------------------ moving
    def depart(self, b: int, moving: Sequence[int], frozen: FrozenIteration, *,
               final: bool) -> Future[Any] | None:
        """Start moving bucket ``b``'s device gradients ``moving`` (``final``: the last
        micro-step, whose statistics validate the step); free them when the rules above say
        so. Returns the transport's future (the local statistics when ``final``)."""
        moving = tuple(sorted(moving))
        free = self.frees(b, frozen) and bool(moving)
        if free:
            self._make_room(frozen)
        if self.sums_on_host(b, frozen):
            summed = self.summed(b)
            fut = self.transport.launch(b, moving, frozen, accumulated=summed, final=final)
            if final:
                self.sums.pop(b, None)
            else:
                self.sums.setdefault(b, set()).update(moving)
        else:
            fut = self.transport.launch(b, moving, frozen)
        if free:
            params = self.state.params
            # the copy task holds the tensors until it has run
            for i in moving:
                params[i].grad = None
            if fut is not None:
                self.in_flight.append((b, fut))
        return fut

    def _make_room(self, frozen: FrozenIteration) -> None:
        """Backward waits here while ``grad_buckets_in_flight`` freed buckets' copies are
        still in flight."""
        while len(self.in_flight) >= frozen.config.grad_buckets_in_flight:
            b, fut = self.in_flight.popleft()
            result = self.wait(fut, f"{self.transport.name} move of bucket {b}'s gradients "
                                    "(OffloadConfig.grad_buckets_in_flight)",
                               frozen.config.watchdog_s)
            if isinstance(result, PendingStats):
                # the copy has landed on the host
                result.done.synchronize()

    def wait(self, future: Future[Any], what: str, watchdog_s: float) -> Any:
        """The bound's wait (the engine's: a lane failure surfaces as its error)."""
        return self.waits.wait(future, what, watchdog_s)
