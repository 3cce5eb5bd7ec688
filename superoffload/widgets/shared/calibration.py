"""Calibrate the planner on a run after its warm-up, once per engine for every view.

The planner is fitted to the engine's own iterations (runtime/calibrator.py, docs/planner.md,
"Calibration on this machine"). Fitted too early it learns the warm-up: the first iterations
of a run pay thread start, allocation and cold caches, and on a busy host they last dozens of
iterations (a fit on them predicted 106 ms for a run that settled at 41-48 ms). So the
calibration waits until the run has warmed up (`warmed_up`: the median iteration time of the
last `SETTLE_WINDOW` iterations is within `SETTLE_TOLERANCE` of the window before, at least
`MIN_WARMUP` iterations in; at most `MAX_WARMUP`), and only then measures its `after`
iterations. The dashboard and the tuner of one run share it (`after_warm_up`): one fit, one
report, the same prediction in both.
"""

from __future__ import annotations

import statistics
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

MIN_WARMUP = 10
"""Iterations a run is never calibrated on, whatever their times."""
MAX_WARMUP = 50
"""A run whose times never settle is calibrated after this many (its report says how
noisy the window was)."""
SETTLE_WINDOW = 8
SETTLE_TOLERANCE = 0.15


def warmed_up(times_s: Sequence[float], *, window: int = SETTLE_WINDOW,
              tolerance: float = SETTLE_TOLERANCE) -> bool:
    """Whether a run whose iteration times so far are `times_s` has warmed up (module
    docstring). Pure."""
    n = len(times_s)
    if n >= MAX_WARMUP:
        return True
    if n < max(MIN_WARMUP, 2 * window):
        return False
    older = statistics.median(times_s[-2 * window:-window])
    newer = statistics.median(times_s[-window:])
    return older > 0 and abs(newer / older - 1.0) <= tolerance


class AfterWarmUp:
    """An `AutoCalibrator` started once the run has warmed up (module docstring). The
    surface the views use: `report`, `error`, `after`, `done`, `on_calibrated`, `wait`."""

    def __init__(self, engine: Any, shape: Any, profile: Any, *, after: int) -> None:
        self.engine, self.shape, self.profile, self.after = engine, shape, profile, after
        self.calibrator: Any = None
        """The AutoCalibrator, once the warm-up is over (None before)."""
        self.warmup_iterations: int | None = None
        """Iterations the warm-up lasted (None while it lasts)."""
        self._times: list[float] = []
        self._seen = -1
        self._callbacks: list[Callable[[Any], None]] = []
        self._opened = threading.Event()
        self._lock = threading.Lock()
        self._leave: Callable[[], None] | None = None

    def start(self) -> AfterWarmUp:
        from superoffload.runtime import step_listener

        self._leave = step_listener.subscribe(self.engine, self.on_step)
        return self

    def on_step(self) -> None:
        """After each step, in the training thread: one scalar read; never raises."""
        try:
            latest = self.engine.telemetry.latest_scalar("iteration_s")
            if latest is None or latest.iteration == self._seen:
                return
            self._seen = latest.iteration
            self._times.append(latest.value)
            if warmed_up(self._times):
                self._open()
        except Exception:
            # a view's calibration must never break training
            self._open()

    def _open(self) -> None:
        from superoffload.runtime.calibrator import AutoCalibrator

        if self._leave is not None:
            self._leave()
            self._leave = None
        with self._lock:
            if self.calibrator is not None:
                return
            self.warmup_iterations = len(self._times)
            self.calibrator = AutoCalibrator(self.engine, self.shape, self.profile,
                                             after=self.after, skip=0).start()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self.calibrator.on_calibrated(fn)
        self._opened.set()

    @property
    def report(self) -> Any:
        return self.calibrator.report if self.calibrator is not None else None

    @property
    def error(self) -> str | None:
        return self.calibrator.error if self.calibrator is not None else None

    @property
    def done(self) -> bool:
        return self.calibrator is not None and bool(self.calibrator.done)

    def on_calibrated(self, fn: Callable[[Any], None]) -> None:
        """Call `fn(report)` when it calibrates (at once when it has)."""
        with self._lock:
            if self.calibrator is None:
                self._callbacks.append(fn)
                return
        self.calibrator.on_calibrated(fn)

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until calibrated (or failed) or `timeout_s`; the report or None."""
        import time

        t0 = time.monotonic()
        if not self._opened.wait(timeout_s):
            return None
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
        return self.calibrator.wait(left)


_shared: weakref.WeakKeyDictionary[Any, dict[tuple[int, Any], AfterWarmUp]]
_shared = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def after_warm_up(engine: Any, shape: Any, profile: Any, *, after: int) -> AfterWarmUp:
    """The calibration of `engine` on `profile` for `shape`, started on first use and shared
    by every view that asks for the same (module docstring)."""
    key = (id(profile), _shape_key(shape))
    with _shared_lock:
        try:
            table = _shared.setdefault(engine, {})
        except TypeError:
            # an engine without weak references: not shared
            return AfterWarmUp(engine, shape, profile, after=after).start()
        found = table.get(key)
        if found is None:
            found = table[key] = AfterWarmUp(engine, shape, profile, after=after).start()
        return found


def _shape_key(shape: Any) -> Any:
    try:
        hash(shape)
        return shape
    except TypeError:
        return id(shape)
