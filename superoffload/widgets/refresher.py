"""A daemon thread that calls one function at a rate, backing off when a call takes long.

The dashboard's refresher: `Refresher(dash.refresh, hz=2).start()`. A timer, not a poll
(`Event.wait`), and never more than ~1/4 of a core: after a call that took t seconds the
next waits at least 3t. What the thread prints goes to the cell that started it; an
exception stops it, is kept in `error` and printed there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from superoffload.widgets import _env


class Refresher:
    """Calls `fn()` every 1/`hz` seconds (or 3x its own duration) until `stop()`."""

    def __init__(self, fn: Callable[[], Any], hz: float, *, name: str) -> None:
        self.fn = fn
        self.hz = check_hz(hz)
        self.name = name
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (no-op while it runs)."""
        if self.running:
            return
        self._stop.clear()
        parent = _env.capture_output_parent()
        self._thread = threading.Thread(target=self._run, args=(parent,), name=self.name,
                                        daemon=True)
        self._thread.start()

    def _run(self, parent: Any) -> None:
        _env.bind_thread_output(parent)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                self.fn()
                took = time.perf_counter() - t0
                self._stop.wait(max(1.0 / self.hz, 3.0 * took))
        except BaseException as exc:  # surface in the cell that started us, then stop
            self.error = exc
            print(f"{self.name} stopped: {exc!r}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait for it (not when called from the thread itself)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def check_hz(hz: float, name: str = "hz") -> float:
    if not hz > 0:
        raise ValueError(f"{name}={hz} must be > 0 (refreshes per second, ~2-5)")
    return float(hz)
