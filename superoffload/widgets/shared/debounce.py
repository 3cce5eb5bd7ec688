"""Run the newest of a burst of jobs, off the calling thread, after a quiet moment.

Why: a slider held down sends a value every few milliseconds, and Jupyter handles widget
messages on the kernel's main thread. Running the planner there for every value made the
tuner lag seconds behind while training shared the two cores. `LatestOnly` keeps the main
thread free: `submit(job)` returns at once, a worker thread waits until `delay_s` passed
without a newer job, runs only the newest one and resolves its Future; superseded jobs are
cancelled. `Inline` runs a job at once in the caller's thread (tests, terminals).

Both are `submit(job) -> Future` (docs/conventions.md, "Lanes: submit -> Future"): exceptions
land in the Future.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol


class Executor(Protocol):
    def submit(self, job: Callable[[], Any]) -> Future[Any]: ...

    def close(self) -> None: ...


class Inline:
    """Runs each job in the caller's thread, at once."""

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(job())
        except BaseException as exc:
            # delivered through the Future, as a thread would
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        pass


class LatestOnly:
    """One daemon worker; runs the newest job once `delay_s` passed since the last submit."""

    def __init__(self, delay_s: float = 0.15, *, name: str = "superoffload-debounce") -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay_s={delay_s!r} must be >= 0 seconds")
        self.delay_s = float(delay_s)
        self.name = name
        self._cond = threading.Condition()
        self._pending: tuple[Callable[[], Any], Future[Any]] | None = None
        self._last_submit = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._pending is not None:
                # superseded before it started
                self._pending[1].cancel()
            self._pending = (job, fut)
            self._last_submit = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                # debounce: wait until no job arrived for delay_s (a timed wait, no polling)
                while True:
                    quiet = time.monotonic() - self._last_submit
                    if quiet >= self.delay_s or self._closed:
                        break
                    self._cond.wait(self.delay_s - quiet)
                if self._pending is None:
                    continue
                job, fut = self._pending
                self._pending = None
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._pending is not None:
                self._pending[1].cancel()
                self._pending = None
            self._cond.notify_all()
