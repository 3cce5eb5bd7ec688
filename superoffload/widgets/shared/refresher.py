"""A daemon thread that calls one function at a rate, giving way to the work it watches.

The dashboard's refresher: `Refresher(dash.refresh, hz=2, busy=lanes_busy).start()`. What it
costs the training it watches is what it takes from the CPU and the GIL, so it

* waits on a timer (`Event.wait`), never a poll, at most `hz` times a second, and after a
  call that took t seconds of its own thread's CPU at least `SHARE` x t longer (never more
  than ~1/`SHARE` of a core however slow a refresh gets);
* gives way to the engine: when `busy()` says a lane has work queued or running at the
  moment a refresh is due, it waits for a gap, up to `GIVE_WAY_TRIES` short waits that
  double from `GIVE_WAY_S`, then refreshes anyway (a figure is never more than
  ~`1/hz + 2 * GIVE_WAY_S * 2**GIVE_WAY_TRIES` s late);
* keeps what it measured (`cpu_s`, `gave_way`) for the benchmark (benchmarks/bench_dashboard.py).

What the thread prints goes to the cell that started it; an exception stops it, is kept in
`error` and printed there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from superoffload.widgets.shared import env as _env

SHARE = 8.0
"""After a call that used t s of CPU, the next waits at least SHARE x t (<= 1/SHARE of a core)."""
GIVE_WAY_S = 0.01
"""The first wait for a gap in the engine's work; each next one doubles."""
GIVE_WAY_TRIES = 5
"""Waits for a gap before refreshing anyway (0.01 + 0.02 + ... + 0.16 = 0.31 s at most)."""


class Refresher:
    """Calls `fn()` every 1/`hz` seconds (or longer: module docstring) until `stop()`."""

    def __init__(self, fn: Callable[[], Any], hz: float, *, name: str,
                 busy: Callable[[], bool] | None = None) -> None:
        self.fn = fn
        self.hz = check_hz(hz)
        self.name = name
        self.busy = busy
        self.error: BaseException | None = None
        self.cpu_s: deque[float] = deque(maxlen=1000)
        """This thread's CPU seconds per call, the newest last."""
        self.gave_way = 0
        """Waits for a gap in the engine's work so far."""
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
                self._give_way()
                if self._stop.is_set():
                    break
                t0 = time.thread_time()
                self.fn()
                took = time.thread_time() - t0
                self.cpu_s.append(took)
                self._stop.wait(max(1.0 / self.hz, SHARE * took))
        except BaseException as exc:
            # surface in the cell that started us, then stop
            self.error = exc
            print(f"{self.name} stopped: {exc!r}")

    def _give_way(self) -> None:
        wait = GIVE_WAY_S
        for _ in range(GIVE_WAY_TRIES):
            if self.busy is None or not self.busy():
                return
            self.gave_way += 1
            if self._stop.wait(wait):
                return
            wait *= 2

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
