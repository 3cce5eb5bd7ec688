"""Transfer tasks, and how the training thread waits for any lane's work.

``D2HTask`` (a bucket's gradients device->host) and ``H2DTask`` (its updated weights
host->device) are frozen task dataclasses run on their own lane (a transfer thread driving,
on CUDA, its own stream). Each records one telemetry span with the bytes it moved (paper
§4.2: a bucket is offloaded the moment its last gradient is final; weights return per
bucket). ``wait_for`` bounds a wait by the watchdog and names the late task; ``InFlight``
keeps what the training thread submitted since the last ``synchronize()`` and waits for it,
a lane's failure surfacing as the engine's own error. Task modules never submit (the lanes
run their tasks: lanes.py), so the calls between them go one way.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.runtime.devices import DeviceOps, GradStats, PendingStats, host_stats
from superoffload.runtime.errors import FailureBox, WatchdogTimeout
from superoffload.runtime.lanes import Lane, describe_lane, explain
from superoffload.telemetry.events import KIND_D2H, KIND_H2D, LANE_D2H, LANE_H2D
from superoffload.telemetry.recorder import Recorder


def wait_for(future: Future[Any], timeout_s: float, what: str) -> Any:
    """Block on ``future`` (no polling); instead of hanging forever, name the task that is
    late, its lane and bucket, and whether a copy or a CPU step is what is stuck."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        late = explain(future)
        where = f": {late.text} ({_hint(late.lane)})" if late.text else ""
        raise WatchdogTimeout(
            f"{what} did not finish within OffloadConfig.watchdog_s={timeout_s:g} s{where}"
        ) from None


class InFlight:
    """Every lane task and publish the training thread submitted since the last drain
    (chained ones included), and its waits: bounded by ``watchdog_s``, a lane's failure raised
    as the engine's own error rather than as the late future's, a stall named with
    ``stall_hint`` (the transport's: what its lanes may be waiting for)."""

    def __init__(self, failures: FailureBox, stall_hint: Callable[[], str]) -> None:
        self.failures, self.stall_hint = failures, stall_hint
        self.futures: list[Future[Any]] = []

    def add(self, future: Future[Any]) -> Future[Any]:
        self.futures.append(future)
        return future

    def forget_done(self) -> None:
        """Keep only the futures still running (a run that never synchronizes does not
        accumulate them)."""
        self.futures = [f for f in self.futures if not f.done()]

    def wait(self, future: Future[Any], what: str, watchdog_s: float) -> Any:
        """``future``'s result, within ``watchdog_s``; a lane failure surfaces as the engine's."""
        try:
            return wait_for(future, watchdog_s, what)
        except WatchdogTimeout as exc:
            self.failures.raise_if_failed()
            raise WatchdogTimeout(f"{exc}; {self.stall_hint()}") from None
        except Exception:
            self.failures.raise_if_failed()
            raise

    def quiet(self, lane: Lane, barrier: Future[Any], watchdog_s: float) -> None:
        """``barrier`` (a ``Barrier`` the caller just submitted to ``lane``) ran: everything
        queued on ``lane`` before it has run. A lane failure surfaces as the engine's error."""
        try:
            wait_for(barrier, watchdog_s, "synchronize")
        except Exception as exc:
            self.failures.raise_if_failed()
            raise type(exc)(f"{describe_lane(lane)}: {exc}") from exc

    def wait_all(self, watchdog_s: float) -> None:
        """Every future added here is done (after the lanes ran a barrier: chained tasks are
        queued late, lanes.py, so each future is waited for itself)."""
        futures, self.futures = self.futures, []
        for fut in futures:
            self.wait(fut, "a task submitted before synchronize()", watchdog_s)


def _is_copy(task: Any) -> bool:
    return isinstance(task, (D2HTask, H2DTask))


def _hint(lane: Lane | None) -> str:
    """What a late task on ``lane`` usually means."""
    if lane is not None and _is_copy(getattr(lane, "current", None)):
        return ("a copy that never ends means a hung device (check nvidia-smi) or a saturated "
                "host; raise OffloadConfig.watchdog_s if it is just slow")
    return ("not a copy: a step on the host is slow or stuck, e.g. an overloaded CPU or a "
            "debugger, or on a GPU a gradient copy that never lands; raise "
            "OffloadConfig.watchdog_s if it is just slow")


def transfer_hint(lanes: Sequence[Lane]) -> str:
    """The transfer lanes' part of a watchdog message: blames the device only when a copy
    is what is running (``LocalTransport.stall_hint``)."""
    names = ", ".join(describe_lane(lane) for lane in lanes)
    if any(_is_copy(getattr(lane, "current", None)) for lane in lanes):
        return (f"transfer lanes: {names}; a copy that never ends means a hung device (check "
                "nvidia-smi) or an overloaded host (raise OffloadConfig.watchdog_s if the copy "
                "is just slow)")
    return f"transfer lanes: {names}: no copy is running"


def tensors_nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, slots=True)
class D2HTask:
    """Copy a bucket's final gradients into its host buffers; return local validation stats."""

    bucket: int
    iteration: int
    grads: tuple[torch.Tensor, ...]
    """Device gradients (``param.grad``) of the members that have one."""
    grad_host: tuple[torch.Tensor, ...]
    """Matching host views; a dtype change here is the device-side cast."""
    ready: Any
    """The device ops' token recorded when the last gradient was final (a CUDA event, or None)."""
    device_ops: DeviceOps
    recorder: Recorder
    add: tuple[bool, ...] | None = None
    """Host accumulation (``OffloadConfig.grad_accum_on="host"``): per gradient, add it into
    its fp32 host sum (True) or start the sum (False); None: a plain copy."""
    stats_host: tuple[torch.Tensor, ...] | None = None
    """Host accumulation, last micro-step: the bucket's statistics are those of these summed
    host views (read after the move), not of the device gradients."""
    want_stats: bool = True
    """False for an earlier micro-step of host accumulation: nothing validates it."""

    def run(self) -> GradStats | PendingStats | None:
        with self.recorder.device_span(
            LANE_D2H, KIND_D2H, stream=self.device_ops.stream("d2h"), iteration=self.iteration,
            bucket=self.bucket,  # what crosses: the host dtype when the device casts first
            nbytes=tensors_nbytes(self.grad_host if self.add is None else self.grads),
        ):
            if self.add is None:
                return self.device_ops.d2h(self.grads, self.grad_host, self.ready)
            if self.grads:
                self.device_ops.d2h_add(self.grads, self.grad_host, self.add, self.ready)
        if not self.want_stats:
            return None
        return host_stats(self.stats_host if self.stats_host is not None else self.grad_host)


@dataclass(frozen=True, slots=True)
class H2DTask:
    """Copy a bucket's updated weights (bf16 copy, or fp32 master cast on the device) back."""

    bucket: int
    iteration: int
    src_host: tuple[torch.Tensor, ...]
    dst_device: tuple[torch.Tensor, ...]
    """``param.data`` of each member (writes bypass autograd's version counter)."""
    after: Future[Any] | None
    """The step (or rollback) this copy publishes; a step that did not run needs no copy."""
    device_ops: DeviceOps
    recorder: Recorder
    watchdog_s: float

    def run(self) -> Any:
        if self.after is not None:
            stepped = wait_for(self.after, self.watchdog_s, f"CPU step of bucket {self.bucket}")
            if stepped is False:
                return None
        with self.recorder.device_span(
            LANE_H2D, KIND_H2D, stream=self.device_ops.stream("h2d"), iteration=self.iteration,
            bucket=self.bucket, nbytes=tensors_nbytes(self.src_host),
        ):
            return self.device_ops.h2d(self.src_host, self.dst_device)
