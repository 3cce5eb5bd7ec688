"""Executors: the small typed concurrency interface of the runtime (STYLE.md §9).

Every lane (D2H transfers, H2D transfers, the CPU optimizer) is an executor with one
method, ``submit(task) -> Future``. A task is a frozen dataclass with a ``run()`` method;
its result or exception travels back through the Future. ``ThreadLane`` runs tasks in
order on one daemon thread, blocking on a queue (no sleep-polling); ``InlineLane`` runs
them in the caller's thread, which makes schedules deterministic in tests.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T", covariant=True)


class Task(Protocol[T]):
    """A unit of work: a frozen dataclass whose ``run()`` returns the result."""

    def run(self) -> T: ...


@dataclass(frozen=True, slots=True)
class Barrier:
    """A no-op task: once it ran, everything submitted before it on that lane has run."""

    def run(self) -> None:
        return None


class LaneClosed(RuntimeError):
    """Raised by ``submit`` after ``close()``."""


class Lane(Protocol):
    name: str

    def submit(self, task: Task[Any]) -> Future[Any]: ...

    def close(self, timeout_s: float | None = 30.0) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout_s: float | None) -> None: ...


ErrorSink = Callable[[str, BaseException], None]
"""Called with (lane name, exception) when a task raises, from the lane's thread."""


def _run_into(task: Task[Any], future: Future[Any], lane: str, on_error: ErrorSink | None) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = task.run()
    except BaseException as exc:  # propagate everything, incl. KeyboardInterrupt-like
        if on_error is not None:  # first, so a waiter woken by the future sees the cause
            on_error(lane, exc)
        future.set_exception(exc)
    else:
        future.set_result(result)


class InlineLane:
    """Runs each task at once in the caller's thread (tests; deterministic)."""

    def __init__(self, name: str, on_error: ErrorSink | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._closed = False

    def submit(self, task: Task[Any]) -> Future[Any]:
        if self._closed:
            raise LaneClosed(f"lane {self.name!r} is closed")
        future: Future[Any] = Future()
        _run_into(task, future, self.name, self._on_error)
        return future

    def close(self, timeout_s: float | None = 30.0) -> None:
        self._closed = True

    def stop(self) -> None:
        self._closed = True

    def join(self, timeout_s: float | None) -> None:
        return None


_STOP = object()


class ThreadLane:
    """One daemon thread running submitted tasks in FIFO order."""

    def __init__(self, name: str, on_error: ErrorSink | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.current: Any = None
        """The task running now (for the watchdog's message), or None."""
        self._thread = threading.Thread(target=self._loop, name=f"superoffload-{name}", daemon=True)
        self._thread.start()

    def submit(self, task: Task[Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise LaneClosed(f"lane {self.name!r} is closed")
            self._queue.put((task, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()  # blocks; no polling
            if item is _STOP:
                return
            task, future = item
            self.current = task
            _run_into(task, future, self.name, self._on_error)
            # drop the references while blocked on the next get(): a finished task's future
            # carries callbacks into the engine, which must stay collectable (lifetime.py)
            self.current = item = task = future = None

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Stop after the queued tasks; idempotent. Pending tasks still run to completion;
        waits at most ``timeout_s`` for them (a daemon thread stuck in a hung copy or
        collective is abandoned, never blocks the caller longer)."""
        self.stop()
        self.join(timeout_s)

    def stop(self) -> None:
        """Ask the thread to exit once the queued tasks ran (returns at once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)

    def join(self, timeout_s: float | None) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def describe(lane: Lane) -> str:
    """What a lane is busy with, e.g. "StepTask of bucket 3" (watchdog messages)."""
    task = getattr(lane, "current", None)
    if task is None:
        return f"lane {lane.name}"
    bucket = getattr(task, "bucket", None)
    what = type(task).__name__ + ("" if bucket is None else f" of bucket {bucket}")
    return f"lane {lane.name} (stuck in {what})"


def make_lane(name: str, *, inline: bool, on_error: ErrorSink | None = None) -> Lane:
    return InlineLane(name, on_error) if inline else ThreadLane(name, on_error)
