"""Lanes: the small typed concurrency interface of the runtime (docs/conventions.md,
"Lanes: submit -> Future").

Every lane (transfers, the CPU optimizer -- the ``cpu_worker`` --, weight fetches) is an
executor with one method, ``submit(task, *, after=(), priority=LAST) -> Future``. A task is
a frozen dataclass with a ``run()`` method; its result or exception travels back through
the Future.

* ``after``: futures the task depends on. The task is queued only once all of them are done
  (a done-callback chains it), so a lane thread never blocks on another task's future: any
  order of priorities is deadlock-free. A failed dependency fails the task's future with the
  same exception, without running it.
* ``priority``: among queued tasks the smallest runs first, ties in submission order. The
  CPU worker and the H2D lane use earliest-deadline-first (DESIGN.md §6: the offloaded
  bucket the next forward needs first is stepped and sent first); ``LAST`` (the default)
  keeps a lane FIFO — collective lanes must stay FIFO, every rank issues them in one order.

``ThreadLane`` runs tasks on one daemon thread, blocking on a condition (no sleep-polling);
``InlineLane`` runs them in the caller's thread (dependencies are always done there), which
makes schedules deterministic in tests.

A lane's future is a ``TaskFuture``: it knows its task, its lane and the futures it waits
for, so a watchdog can say which task at the end of a chain is late (``explain``: "H2DTask of
bucket 2 waits for StepTask of bucket 2, queued on lane cpu_worker behind StepTask of bucket
3, running for 2.0 s") instead of naming only the future it waited on.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T", covariant=True)

Priority = tuple[float, ...]
LAST: Priority = (math.inf,)
"""The default priority: after every prioritised task, FIFO among themselves."""


class Task(Protocol[T]):
    """A unit of work: a frozen dataclass whose ``run()`` returns the result."""

    def run(self) -> T: ...


@dataclass(frozen=True, slots=True)
class Barrier:
    """A no-op task: once it ran, everything queued before it on that lane has run."""

    def run(self) -> None:
        return None


class LaneClosed(RuntimeError):
    """Raised by ``submit`` after ``close()`` (or set on a chained task's future)."""


class TaskFuture(Future[Any]):
    """A lane's future: what it runs (a label, not the task: a kept future holds no
    buffers), where, and after which futures until it is queued (for ``explain``)."""

    def __init__(self, lane: Lane, task: Any, after: Sequence[Future[Any]]) -> None:
        super().__init__()
        self.lane = lane
        self.label = task_label(task)
        self.after: tuple[Future[Any], ...] = tuple(after)
        self.started_s: float | None = None
        """``time.monotonic()`` when the task began running; None before."""


def task_label(task: Any) -> str:
    """"StepTask of bucket 3": the task's type and, when it has one, its bucket."""
    bucket = getattr(task, "bucket", None)
    return type(task).__name__ + ("" if bucket is None else f" of bucket {bucket}")


class Lane(Protocol):
    name: str

    def submit(self, task: Task[Any], *, after: Sequence[Future[Any]] = (),
               priority: Priority = LAST) -> Future[Any]: ...

    def close(self, timeout_s: float | None = 30.0) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout_s: float | None) -> None: ...

    def abandon(self) -> None: ...


ErrorSink = Callable[[str, BaseException], None]
"""Called with (lane name, exception) when a task raises, from the lane's thread."""


def _run_into(task: Task[Any], future: Future[Any], lane: str, on_error: ErrorSink | None) -> None:
    if not future.set_running_or_notify_cancel():
        return
    if isinstance(future, TaskFuture):
        # deps are done: let them go
        future.started_s, future.after = time.monotonic(), ()
    try:
        result = task.run()
    except BaseException as exc:  # propagate everything, incl. KeyboardInterrupt-like
        if on_error is not None:  # first, so a waiter woken by the future sees the cause
            on_error(lane, exc)
        future.set_exception(exc)
    else:
        future.set_result(result)


def _when_done(deps: Sequence[Future[Any]], future: Future[Any],
               go: Callable[[], None]) -> None:
    """Call ``go()`` once every dep is done; fail ``future`` instead if one failed."""
    pending = [d for d in deps if not d.done()]
    failed = next((d for d in deps if d.done() and d.exception() is not None), None)
    if failed is not None:
        if future.set_running_or_notify_cancel():
            future.set_exception(failed.exception())  # type: ignore[arg-type]
        return
    if not pending:
        go()
        return
    lock, left = threading.Lock(), [len(pending)]

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            # all done now: re-check for a failure, then go
            _when_done(deps, future, go)

    for d in pending:
        d.add_done_callback(one_done)


class InlineLane:
    """Runs each task at once in the caller's thread (tests; deterministic)."""

    def __init__(self, name: str, on_error: ErrorSink | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._closed = False

    def submit(self, task: Task[Any], *, after: Sequence[Future[Any]] = (),
               priority: Priority = LAST) -> Future[Any]:
        if self._closed:
            raise LaneClosed(f"lane {self.name!r} is closed")
        future = TaskFuture(self, task, after)
        _when_done(after, future, lambda: _run_into(task, future, self.name, self._on_error))
        return future

    def close(self, timeout_s: float | None = 30.0) -> None:
        self._closed = True

    def stop(self) -> None:
        self._closed = True

    def join(self, timeout_s: float | None) -> None:
        return None

    def abandon(self) -> None:
        return None


_STOP = object()


class ThreadLane:
    """One daemon thread running queued tasks, smallest priority first (see module doc)."""

    def __init__(self, name: str, on_error: ErrorSink | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._heap: list[tuple[Priority, int, Any, Any]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._abandoned = False
        self.current: Any = None
        """The task running now (for the watchdog's message), or None."""
        self.current_since_s = 0.0
        """``time.monotonic()`` when ``current`` began."""
        self.progress_s = time.monotonic()
        """When a task last began or ended here (``lifetime.quiesce``: is work progressing?)."""
        self._thread = threading.Thread(target=self._loop, name=f"superoffload-{name}", daemon=True)
        self._thread.start()

    def submit(self, task: Task[Any], *, after: Sequence[Future[Any]] = (),
               priority: Priority = LAST) -> Future[Any]:
        with self._cond:
            if self._closed:
                raise LaneClosed(f"lane {self.name!r} is closed")
        future = TaskFuture(self, task, after)
        _when_done(after, future, lambda: self._enqueue(priority, task, future))
        return future

    def _enqueue(self, priority: Priority, task: Any, future: Future[Any]) -> None:
        with self._cond:
            if self._closed and task is not _STOP:
                if future.set_running_or_notify_cancel():
                    future.set_exception(LaneClosed(f"lane {self.name!r} closed before "
                                                    "this task's dependencies finished"))
                return
            heapq.heappush(self._heap, (priority, next(self._seq), task, future))
            if isinstance(future, TaskFuture):
                # done: nothing to explain there any more
                future.after = ()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    # blocks; no polling
                    self._cond.wait()
                _, _, task, future = heapq.heappop(self._heap)
            if task is _STOP:
                return
            self.current, self.current_since_s = task, time.monotonic()
            self.progress_s = self.current_since_s
            _run_into(task, future, self.name, self._on_error)
            # drop the references while blocked on the next task: a finished task's future
            # carries callbacks into the engine, which must stay collectable (lifetime.py)
            self.current = task = future = None
            self.progress_s = time.monotonic()

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Stop after the queued tasks; idempotent. Queued tasks still run to completion;
        waits at most ``timeout_s`` for them (a daemon thread stuck in a hung copy or
        collective is abandoned, never blocks the caller longer)."""
        self.stop()
        self.join(timeout_s)

    def stop(self) -> None:
        """Ask the thread to exit once the queued tasks ran (returns at once)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._enqueue((math.inf, math.inf), _STOP, Future())

    def join(self, timeout_s: float | None) -> None:
        """Wait for the thread to exit, at most ``timeout_s``; a lane that did not exit in
        time once, or was ``abandon``ed, is not waited for again (a hung task would make
        every later close wait its full timeout)."""
        if threading.current_thread() is self._thread or self._abandoned:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandoned = True

    def abandon(self) -> None:
        """Give up on a stuck task: later joins return at once (the thread is a daemon)."""
        self._abandoned = True

    @property
    def busy(self) -> bool:
        """A task (not a ``Barrier``) is running or queued here."""
        def real(task: Any) -> bool:
            return task is not None and task is not _STOP and not isinstance(task, Barrier)

        with self._cond:
            return real(self.current) or any(real(t) for _, _, t, _ in self._heap)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def describe_lane(lane: Lane) -> str:
    """What a lane is busy with, e.g. "lane cpu_worker (stuck in StepTask of bucket 3 for
    2.0 s)" (watchdog messages); "lane d2h (idle)" when it runs nothing."""
    task = getattr(lane, "current", None)
    if task is None:
        return f"lane {lane.name} (idle)"
    since = getattr(lane, "current_since_s", None)
    running = ""
    # a lane that does not time its tasks (the inline one) reports no duration
    if since is not None:
        running = f" for {time.monotonic() - since:.1f} s"
    return f"lane {lane.name} (stuck in {task_label(task)}{running})"


@dataclass(frozen=True, slots=True)
class Lateness:
    """Why a future is not done (``explain``)."""

    text: str
    """E.g. "H2DTask of bucket 2 waits for StepTask of bucket 2, running on lane cpu_worker
    for 2.0 s"; "" for a future no lane made (nothing is known about it)."""
    lane: Lane | None = None
    """The lane of the late task: running it, or running what it is queued behind."""


def explain(future: Future[Any]) -> Lateness:
    """Follow ``future``'s unfinished dependencies to the task that is late and say where it
    is: running on a lane (for how long), or queued behind another task there."""
    labels: list[str] = []
    f: Future[Any] = future
    # dependency chains are a few tasks long; never loop forever
    for _ in range(32):
        if not isinstance(f, TaskFuture) or f.done():
            break
        labels.append(f.label)
        chain = " waits for ".join(labels)
        if f.started_s is not None:
            running = time.monotonic() - f.started_s
            return Lateness(f"{chain}, running on lane {f.lane.name} for {running:.1f} s",
                            f.lane)
        pending = [d for d in f.after if not d.done()]
        if pending:
            f = pending[0]
            continue
        current = getattr(f.lane, "current", None)
        if current is None:
            return Lateness(f"{chain}, queued on lane {f.lane.name}", f.lane)
        since = time.monotonic() - getattr(f.lane, "current_since_s", time.monotonic())
        return Lateness(f"{chain}, queued on lane {f.lane.name} behind {task_label(current)}, "
                        f"running for {since:.1f} s", f.lane)
    return Lateness(" waits for ".join(labels))


def make_lane(name: str, *, inline: bool, on_error: ErrorSink | None = None) -> Lane:
    # inline: tests run every task in the caller's thread, in submission order
    if inline:
        return InlineLane(name, on_error)
    return ThreadLane(name, on_error)
