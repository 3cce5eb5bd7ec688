"""`BackgroundTrainer`: run a training loop in a thread started by a notebook cell.

Why a thread: Jupyter does not deliver widget input (a slider move, a button press) to a
cell that is still running, so training that should react to the tuner must not occupy
the cell. Updates the other way (dashboard traces, a progress bar) reach the browser from
any thread. What the thread prints is routed to the cell that started it (ipykernel routes
output by the parent message of the current request; see `_env.bind_thread_output`).

    trainer = BackgroundTrainer(step_fn, steps=200, dashboard=dash).start()
    ...                           # other cells run; sliders work; apply reconfigures
    result = trainer.wait()       # re-raises an exception from the thread

`engine_step_fn(engine, model, batches)` builds the usual step function.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from superoffload.widgets import _env


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What a background run did."""

    steps_done: int
    losses: list[float] = field(default_factory=list)
    stopped_early: bool = False
    wall_s: float = 0.0

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else math.nan

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


class BackgroundTrainer:
    """Calls `step_fn(i)` for i in range(steps) on a daemon thread until done or stopped.

    `step_fn` does one optimizer iteration (forward, `engine.backward`, `engine.step`,
    `engine.zero_grad`) and returns the loss as a float (or None). A `dashboard`, when
    given, is refreshed from its own thread while this one runs and once more at the end.
    """

    def __init__(
        self,
        step_fn: Callable[[int], Any],
        steps: int,
        *,
        dashboard: Any = None,
        print_every: int = 0,
        name: str = "superoffload-train",
    ) -> None:
        if not callable(step_fn):
            raise TypeError(f"step_fn={step_fn!r} must be callable as step_fn(iteration) -> loss")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps={steps!r} must be a whole number >= 1")
        if not isinstance(print_every, int) or print_every < 0:
            raise ValueError(f"print_every={print_every!r} must be a whole number >= 0 (0: silent)")
        self.step_fn = step_fn
        self.steps = steps
        self.dashboard = dashboard
        self.print_every = print_every
        self.name = name
        self.losses: list[float] = []
        self.steps_done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._progressed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._wall_s = 0.0
        self.progress: Any = _make_progress(steps)

    def start(self) -> BackgroundTrainer:
        """Start the thread (and the dashboard's refresher); returns self."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already started; make a new BackgroundTrainer")
        parent = _env.capture_output_parent()
        if self.dashboard is not None and getattr(self.dashboard, "recorder", None) is not None:
            self.dashboard.start()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(parent,), name=self.name, daemon=True)
        self._thread.start()
        return self

    def _run(self, parent: Any) -> None:
        _env.bind_thread_output(parent)
        try:
            for i in range(self.steps):
                if self._stop.is_set():
                    break
                loss = self.step_fn(i)
                if loss is not None:
                    self.losses.append(float(loss))
                with self._progressed:
                    self.steps_done = i + 1
                    self._progressed.notify_all()
                self._show_progress()
                if self.print_every and (i + 1) % self.print_every == 0:
                    print(f"step {i + 1}/{self.steps} loss {self.losses[-1] if self.losses else math.nan:.4f}")
        except BaseException as exc:  # kept for wait(), shown in the starting cell
            self.error = exc
            print(f"{self.name} failed at step {self.steps_done}: {exc!r}")
        finally:
            self._wall_s = time.perf_counter() - self._t0
            if self.dashboard is not None and getattr(self.dashboard, "recorder", None) is not None:
                self.dashboard.stop()
            self._show_progress(final=True)
            self._done.set()
            with self._progressed:
                self._progressed.notify_all()

    def stop(self, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Ask the loop to stop after the current step; optionally wait for it."""
        self._stop.set()
        if wait:
            self._done.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> TrainResult:
        """Block until the run ends; re-raise its exception; return what it did."""
        if self._thread is None:
            raise RuntimeError(f"{self.name} was never started: call .start() first")
        if not self._done.wait(timeout_s):
            raise TimeoutError(
                f"{self.name} still running after {timeout_s} s ({self.steps_done}/{self.steps} "
                "steps); call .stop() or wait longer"
            )
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed at step {self.steps_done}") from self.error
        return TrainResult(
            steps_done=self.steps_done,
            losses=list(self.losses),
            stopped_early=self.steps_done < self.steps,
            wall_s=self._wall_s,
        )

    def wait_for_steps(self, steps: int, timeout_s: float = 60.0) -> int:
        """Block until at least `steps` steps are done (or the run ended); return steps done.

        Use it before changing settings that must land on a *later* iteration than the first.
        """
        if self._thread is None:
            raise RuntimeError(f"{self.name} was never started: call .start() first")
        with self._progressed:
            reached = self._progressed.wait_for(
                lambda: self.steps_done >= steps or self._done.is_set(), timeout_s
            )
        if not reached:
            raise TimeoutError(
                f"{self.name} did only {self.steps_done} of {steps} steps in {timeout_s} s"
            )
        return self.steps_done

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def status(self) -> str:
        state = "running" if self.running else ("failed" if self.error else "done")
        loss = f", loss {self.losses[-1]:.4f}" if self.losses else ""
        return f"{self.name}: {state}, step {self.steps_done}/{self.steps}{loss}"

    def _show_progress(self, final: bool = False) -> None:
        if self.progress is None:
            return
        bar, label = self.progress.children
        bar.value = self.steps_done
        label.value = self.status()
        if final:
            bar.bar_style = "danger" if self.error else "success"

    def _ipython_display_(self) -> None:
        if self.progress is None:
            print(self.status())
        else:
            _env.display_or_print(self.progress, self.status())


def _make_progress(steps: int) -> Any:
    """A progress bar and a status label (None without ipywidgets)."""
    if not _env.has_module("ipywidgets"):
        return None
    import ipywidgets as w

    return w.HBox([w.IntProgress(value=0, min=0, max=steps), w.Label(value="not started")])


def engine_step_fn(engine: Any, model: Any, batches: Any) -> Callable[[int], float]:
    """`step_fn` for one engine iteration on the next batch: forward, `engine.backward`,
    `engine.step`, `engine.zero_grad` (the body of `superoffload.train_loop.train`, without
    its learning-rate schedule). `batches.next_batch()` returns (inputs, targets)."""
    device = next(iter(model.parameters())).device

    def step(_i: int) -> float:
        x, y = batches.next_batch()
        loss = model(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return float(loss.detach())

    return step
