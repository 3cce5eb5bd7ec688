"""Measure a settings change as an interleaved A/B while the engine trains (docs/planner.md,
"Apply, measured: an interleaved A/B").

``ABTrial(engine, old, new).start()`` alternates the old (A) and new (B) settings through
the public ``engine.reconfigure`` -- applied where the next iteration starts -- for `block`
measured iterations each, `pairs` times, and ends with the new settings in force. Each
switch's first `settle` iterations are not measured: the change lands inside that iteration
(a ratio change drains the lanes and rebuilds the buckets there). Iteration times are the
time between two ``step()`` ends, as the engine's own ``iteration_s`` scalar: the trial
listens after every ``engine.optimizer.step()`` (runtime/step_listener.py: torch's
``Optimizer.register_step_post_hook``), so it runs in the training thread, between
iterations, whatever loop drives the engine. The statistics are
telemetry/abtest.py's; the result is written to the run's record as a telemetry note
(``engine.telemetry.note``), kept on the trial and handed to ``on_done``.

A hook never raises into training: a refused change ends the trial with ``error`` set and
the new settings requested once more. ``cancel()`` (e.g. when the run stops, or another
Apply) ends it with the new settings in force.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from superoffload.runtime import step_listener
from superoffload.telemetry.abtest import ABResult, analyse

NOTE_PREFIX = "A/B"
"""Telemetry notes of a trial start with it (start, result, cancel)."""
_RUNNING: dict[int, ABTrial] = {}
"""id(engine) -> its trial in progress (a new one cancels the old: one engine, one trial)."""


class ABTrial:
    """One interleaved A/B of `old` vs `new` settings on a training engine (module doc)."""

    def __init__(self, engine: Any, old: Mapping[str, Any], new: Mapping[str, Any], *,
                 block: int = 4, pairs: int = 6, settle: int = 1,
                 predicted_change: float | None = None,
                 on_done: Callable[[ABTrial], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if set(old) != set(new) or not new:
            raise ValueError(f"ABTrial: old {sorted(old)} and new {sorted(new)} must set the "
                             "same, non-empty fields")
        for name, value in (("block", block), ("pairs", pairs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ABTrial.{name}={value!r}: use a whole number >= 1")
        if not isinstance(settle, int) or settle < 0:
            raise ValueError(f"ABTrial.settle={settle!r}: use a whole number >= 0")
        if not step_listener.supported(engine):
            raise ValueError(f"{type(engine).__name__} has no torch optimizer to listen to "
                             "(engine.optimizer.register_step_post_hook): apply without a trial")
        self.engine, self.old, self.new = engine, dict(old), dict(new)
        self.block, self.pairs, self.settle = block, pairs, settle
        self.predicted_change = predicted_change
        self.on_done = on_done
        self.clock = clock
        """Seconds now (perf_counter; tests pass a simulated clock)."""
        self.result: ABResult | None = None
        self.error: str | None = None
        self.a_blocks: list[list[float]] = []
        self.b_blocks: list[list[float]] = []
        self._leave: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._last_end: float | None = None
        self._last_iteration = -1
        # 0: A1, 1: B1, 2: A2, ... (2 * pairs phases)
        self._phase = 0
        self._skip = settle
        self._first = -1

    # ----------------------------------------------------------------- control
    def start(self) -> ABTrial:
        """Listen from the next step on (the old settings are in force: A comes first)."""
        # a bad value fails here, in the caller
        self.engine.config.replace(**self.new)
        current = _RUNNING.get(id(self.engine))
        if current is not None and current is not self:
            current.cancel("replaced by a newer Apply")
        _RUNNING[id(self.engine)] = self
        self._leave = step_listener.subscribe(self.engine, self.on_step)
        self._note(f"{NOTE_PREFIX} started: {self._what()}, {self.pairs} pairs of "
                   f"{self.block} iterations (+{self.settle} settling per switch)")
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def progress(self) -> str:
        """"pair 2 of 6, new settings" while it runs."""
        with self._lock:
            if self._done.is_set():
                if self.error is not None:
                    return f"failed: {self.error}"
                return "done"
            arm = "old" if self._phase % 2 == 0 else "new"
            return f"pair {self._phase // 2 + 1} of {self.pairs}, {arm} settings"

    def wait(self, timeout_s: float | None = None) -> ABResult | None:
        """Block until the trial ends (or `timeout_s`); its result (None: failed, cancelled)."""
        self._done.wait(timeout_s)
        return self.result

    def cancel(self, why: str = "cancelled") -> None:
        """End now with the new settings in force (no result unless it had finished)."""
        with self._lock:
            if self._done.is_set():
                return
            self.error = why
            self._finish_locked()
        self._apply(self.new)
        self._note(f"{NOTE_PREFIX} {why}: {self._what()} left in force, no measurement")

    # ----------------------------------------------------------------- the hook
    def on_step(self) -> None:
        """After every ``optimizer.step()``, in the training thread; never raises."""
        try:
            self._step()
        except Exception as exc:  # a trial must never break training
            with self._lock:
                self.error = f"{type(exc).__name__}: {exc}"
                self._finish_locked()
            self._apply(self.new)

    def _step(self) -> None:
        now = self.clock()
        iteration = int(getattr(self.engine, "iteration", self._last_iteration + 1))
        with self._lock:
            if self._done.is_set() or iteration == self._last_iteration:
                # finished, or a gradient-accumulation micro-step (no iteration ended)
                return
            previous, self._last_end = self._last_end, now
            self._last_iteration = iteration
            if previous is None:
                # the iteration in flight at start() began before the trial
                return
            if self._skip:
                self._skip -= 1
                return
            if self._first < 0:
                self._first = iteration - 1
            # phases alternate A1, B1, A2, ...: an even phase runs the old settings
            blocks = self.b_blocks
            if self._phase % 2 == 0:
                blocks = self.a_blocks
            if len(blocks) <= self._phase // 2:
                blocks.append([])
            blocks[self._phase // 2].append(now - previous)
            if len(blocks[self._phase // 2]) < self.block:
                return
            self._phase += 1
            self._skip = self.settle
            finished = self._phase == 2 * self.pairs
            # the next phase's settings, applied after the lock is released
            settings = self.new
            if self._phase % 2 == 0:
                settings = self.old
        if finished:
            self._conclude(iteration - 1)
        else:
            self.engine.reconfigure(**settings)

    def _conclude(self, last: int) -> None:
        result = analyse(self.a_blocks, self.b_blocks,
                         changes={k: (self.old[k], self.new[k]) for k in self.new},
                         predicted_change=self.predicted_change, iterations=(self._first, last))
        with self._lock:
            self.result = result
            self._finish_locked()
        self._note(result.line())
        if self.on_done is not None:
            self.on_done(self)

    def _finish_locked(self) -> None:
        if self._leave is not None:
            self._leave()
            self._leave = None
        if _RUNNING.get(id(self.engine)) is self:
            del _RUNNING[id(self.engine)]
        self._done.set()

    def _apply(self, settings: Mapping[str, Any]) -> None:
        try:
            self.engine.reconfigure(**settings)
        except Exception as exc:  # an engine that closed meanwhile: nothing to leave in force
            self.error = (self.error or "") + f" (could not restore: {exc})"

    def _what(self) -> str:
        return ", ".join(f"{k} {self.old[k]!r} -> {self.new[k]!r}" for k in self.new)

    def _note(self, text: str) -> None:
        telemetry = getattr(self.engine, "telemetry", None)
        if telemetry is not None:
            telemetry.note(int(getattr(self.engine, "iteration", -1)), text)
