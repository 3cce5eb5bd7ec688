"""`BackgroundTrainer`: run a training loop in a thread started by a notebook cell.

Why a thread: Jupyter does not deliver widget input (a slider move, a button press) to a
cell that is still running, so training that should react to the tuner must not occupy
the cell. Updates the other way (dashboard traces, a progress bar) reach the browser from
any thread. What the thread prints is routed to the cell that started it (ipykernel routes
output by the parent message of the current request; see `_env.bind_thread_output`).

    trainer = BackgroundTrainer(step_fn, max_s=300, dashboard=dash, tuner=tuner).start()
    ...                           # other cells run; sliders work; apply reconfigures
    trainer.stop()                # or the Stop button under the progress line
    result = trainer.wait()       # re-raises an exception from the thread

`steps=N` stops after N steps, `max_s` after that many seconds, neither: when stopped. The run's
state (running, finished, stopped, failed) is shown on the progress line and handed to the
dashboard and the tuner (`set_run_state`). One run per engine (widgets/shared/owners.py):
starting a trainer on an engine another trainer is training (a re-run cell) stops that one
first, after its current step, and says so; its views are frozen, except those the new run
shares (the tuner). `trainer.show_status()` shows a second live status line (e.g. in a check
cell at the bottom, where Run All leaves the view). When the run ends, the progress line and
every status line are replaced in place by static text of the final state (`slots.LiveOutput`),
so a saved notebook keeps it. `engine_step_fn(engine, model, batches)` builds the usual step
function.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared import owners
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.runstate import RunState

TAKE_OVER_S = 120.0
"""How long a new start waits for the run it replaces to finish its current step."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What a background run did."""

    steps_done: int
    losses: list[float] = field(default_factory=list)
    stopped_early: bool = False
    """Stopped by the user (`stop()`, the Stop button) before its steps or time were up."""
    wall_s: float = 0.0
    state: RunState = RunState.FINISHED

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else math.nan

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


class BackgroundTrainer:
    """Calls `step_fn(i)` for i = 0, 1, ... on a daemon thread until `steps` are done,
    `max_s` seconds passed or `stop()`. `step_fn` does one optimizer iteration and returns
    the loss as a float (or None). A `dashboard` and a `tuner`, when given, are told the
    run's state; the dashboard refreshes from its own thread while this one runs."""

    def __init__(self, step_fn: Callable[[int], Any], steps: int | None = None, *,
                 max_s: float | None = None, dashboard: Any = None, tuner: Any = None,
                 print_every: int = 0, name: str = "superoffload-train") -> None:
        if not callable(step_fn):
            raise TypeError(f"step_fn={step_fn!r} must be callable as step_fn(iteration) -> loss")
        # bool is an int to Python: steps=True would train one step by accident
        whole = isinstance(steps, int) and not isinstance(steps, bool)
        if steps is not None and (not whole or steps < 1):
            raise ValueError(f"steps={steps!r} must be a whole number >= 1 (None: until stopped)")
        if max_s is not None and not max_s > 0:
            raise ValueError(f"max_s={max_s!r} must be > 0 seconds (None: no time limit)")
        if not isinstance(print_every, int) or print_every < 0:
            raise ValueError(f"print_every={print_every!r} must be a whole number >= 0 (0: silent)")
        self.step_fn = step_fn
        self.steps = steps
        self.max_s = max_s
        self.dashboard = dashboard
        self.tuner = tuner
        self.print_every = print_every
        self.name = name
        self.losses: list[float] = []
        self.steps_done = 0
        self.error: BaseException | None = None
        self.state = RunState.NOT_STARTED
        self._stop = threading.Event()
        self._done = threading.Event()
        self._progressed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._wall_s = 0.0
        self._shown_at = 0.0
        self._outputs: list[snap.LiveOutput] = []
        self.replaced_by: BackgroundTrainer | None = None
        """The run that took this one's engine over (a re-run cell), if one did."""
        self.key: Any = owners.run_key(step_fn, dashboard, tuner)
        """What this run trains (widgets/shared/owners.py): its engine, or its dashboard's
        recorder."""
        self.progress: Any = self._make_progress()
        self.live_label: Any = self._make_live_label()

    # ----------------------------------------------------------------- control
    def start(self) -> BackgroundTrainer:
        """Start the thread (and the dashboard's refresher); returns self."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already started; make a new BackgroundTrainer")
        self._take_over()
        parent = _env.capture_output_parent()
        self._t0 = time.perf_counter()
        self._set_state(RunState.RUNNING)
        if self.dashboard is not None and getattr(self.dashboard, "recorder", None) is not None:
            self.dashboard.start()
        # a daemon: a kernel that exits mid-run is not held by the training thread
        self._thread = threading.Thread(target=self._run, args=(parent,), name=self.name,
                                        daemon=True)
        self._thread.start()
        return self

    def _take_over(self) -> None:
        """Stop the run that trains this one's engine now, if any (widgets/shared/owners.py)."""
        previous = owners.claim("training", self.key, self)
        if previous is None or not previous.running:
            return
        print(f"{self.name}: one run per engine: stopping the run started before "
              f"({previous.status()}) after its current step; this one takes over")
        previous.replaced_by = self
        previous.stop(wait=True, timeout_s=TAKE_OVER_S)
        if previous.running:
            owners.claim("training", self.key, previous)
            previous.replaced_by = None
            raise RuntimeError(f"{self.name}: the run started before ({previous.status()}) "
                               f"did not stop within {TAKE_OVER_S:.0f} s; it still trains "
                               "this engine. Press its Stop button, or call "
                               "BackgroundTrainer.training(engine).stop(), then start again")

    @staticmethod
    def training(engine: Any) -> BackgroundTrainer | None:
        """The trainer that holds `engine` (or a dashboard's recorder) now, if any: a handle
        on a run whose cell was run again."""
        return owners.owner_of("training", owners.run_key(engine))  # type: ignore[no-any-return]

    def _run(self, parent: Any) -> None:
        _env.bind_thread_output(parent)
        try:
            i = 0
            while not self._stop.is_set() and (self.steps is None or i < self.steps):
                if self.max_s is not None and time.perf_counter() - self._t0 >= self.max_s:
                    break
                loss = self.step_fn(i)
                if loss is not None:
                    self.losses.append(float(loss))
                i += 1
                with self._progressed:
                    self.steps_done = i
                    self._progressed.notify_all()
                self._show_progress()
                if self.print_every and i % self.print_every == 0:
                    print(f"step {i} loss {self.losses[-1] if self.losses else math.nan:.4f}")
        except BaseException as exc:
            # kept for wait(), shown in the starting cell
            self.error = exc
            print(f"{self.name} failed at step {self.steps_done}: {exc!r}")
        finally:
            self._wall_s = time.perf_counter() - self._t0
            ended = (RunState.FAILED if self.error is not None else
                     RunState.STOPPED if self._stop.is_set() else RunState.FINISHED)
            self._set_state(ended)
            owners.release("training", self.key, self)
            self._done.set()
            with self._progressed:
                self._progressed.notify_all()
            # the saved notebook keeps the final state, not a dead widget
            self.freeze()

    def _set_state(self, state: RunState) -> None:
        self.state = state
        self._show_progress(force=True)
        new = self.replaced_by
        for view in (self.dashboard, self.tuner):
            if state.ended and new is not None and view in (new.dashboard, new.tuner):
                # the run that took over shows it now: it is not ended
                continue
            setter = getattr(view, "set_run_state", None)
            if setter is not None:
                try:
                    setter(state)
                except Exception as exc:
                    # a view must never kill the run
                    print(f"{self.name}: {type(view).__name__}.set_run_state failed: {exc!r}")

    def stop(self, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Ask the loop to stop after the current step; optionally wait for it."""
        self._stop.set()
        if wait and self._thread is not None:
            self._done.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> TrainResult:
        """Block until the run ends; re-raise its exception; return what it did."""
        if self._thread is None:
            raise RuntimeError(f"{self.name} was never started: call .start() first")
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self.name} still running after {timeout_s} s ({self.steps_done} "
                               "steps); call .stop() or wait longer")
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed at step {self.steps_done}") from self.error
        return TrainResult(steps_done=self.steps_done, losses=list(self.losses),
                           stopped_early=self.state is RunState.STOPPED, wall_s=self._wall_s,
                           state=self.state)

    def wait_for_steps(self, steps: int, timeout_s: float = 60.0) -> int:
        """Block until at least `steps` steps are done (or the run ended); return steps done."""
        if self._thread is None:
            raise RuntimeError(f"{self.name} was never started: call .start() first")
        with self._progressed:
            reached = self._progressed.wait_for(
                lambda: self.steps_done >= steps or self._done.is_set(), timeout_s)
        if not reached:
            raise TimeoutError(f"{self.name} did only {self.steps_done} of {steps} steps in "
                               f"{timeout_s} s")
        return self.steps_done

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    # ----------------------------------------------------------------- display
    def status(self) -> str:
        """One plain-text line: state, steps, time, last loss."""
        # a run still going counts to now; an ended one keeps the wall time it stopped at
        elapsed = 0.0
        if self._t0:
            elapsed = time.perf_counter() - self._t0 if self.running else self._wall_s
        limit = []
        if self.steps is not None:
            limit.append(f"of {self.steps}")
        text = f"{self.name}: {self.state.value}, step {self.steps_done} {' '.join(limit)}".rstrip()
        if self.replaced_by is not None and self.state.ended:
            text += " (replaced by a run started later on the same engine)"
        text += f", {elapsed:.0f} s"
        if self.state is RunState.RUNNING:
            if self.max_s is not None:
                text += f" (stops after {self.max_s:.0f} s)"
            elif self.steps is None:
                text += " (until stopped)"
        if self.losses:
            text += f", loss {self.losses[-1]:.4f}"
        return text

    def freeze(self) -> None:
        """Replace the progress line and every live status line shown with static text of
        the current state (at the run's end, and by the kernel's exit hook). At the kernel's
        exit the run is asked to stop first: its thread dies with the process anyway, and
        while it trains it competes for the interpreter with the snapshots that must reach
        the notebook before the kernel is gone."""
        if snap.exiting:
            self._stop.set()
        for out in self._outputs:
            out.freeze()

    def show_status(self) -> None:
        """Show a second, live status line here (e.g. in a check cell far below the trainer's
        cell, where Run All leaves the view); frozen into text when the run ends."""
        if self.live_label is None or not _env.in_notebook():
            print(self.status())
            return
        self._show(self.live_label, "trainer-status")

    def _show(self, widget: Any, name: str) -> None:
        out = snap.LiveOutput(name, widget, lambda: [self.status()],
                              css_class=f"so-{name}-snapshot")
        out.show()
        self._outputs.append(out)
        if self.state.ended:
            out.freeze()

    def _make_live_label(self) -> Any:
        if not _env.has_module("ipywidgets"):
            return None
        import ipywidgets as w

        label = w.HTML(value=html.escape(self.status()))
        label.add_class("so-trainer-live")
        return label

    def _make_progress(self) -> Any:
        """Progress bar, status line and a Stop button (None without ipywidgets)."""
        if not _env.has_module("ipywidgets"):
            return None
        import ipywidgets as w

        bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, layout=w.Layout(width="200px"))
        label = w.Label(value="not started")
        label.add_class("so-trainer-status")
        button = w.Button(description="Stop training", button_style="warning", icon="stop",
                          tooltip="stop after the current step (trainer.stop())")
        button.add_class("so-trainer-stop")
        button.on_click(lambda _b: self.stop(wait=False))
        box = w.HBox([bar, label, button])
        box.add_class("so-trainer")
        return box

    def _show_progress(self, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        if not force and now - self._shown_at < 0.5:
            # at most 2 updates a second: each one is a message to the browser
            return
        self._shown_at = now
        bar, label, button = self.progress.children
        if self.steps is not None:
            bar.value = self.steps_done / self.steps
        elif self.max_s is not None and self._t0:
            bar.value = min(1.0, (now - self._t0) / self.max_s)
        label.value = self.status()
        if self.live_label is not None:
            self.live_label.value = html.escape(label.value)
        if self.state.ended:
            bar.value = 1.0 if self.state is RunState.FINISHED else bar.value
            style = {"failed": "danger", "stopped": "warning"}.get(self.state.value, "success")
            bar.bar_style = style
            button.disabled = True
            button.description = self.state.value

    def _ipython_display_(self) -> None:
        if self.progress is None or not _env.in_notebook():
            print(self.status())
        else:
            self._show(self.progress, "trainer")


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

    # what the run trains (widgets/shared/owners.py)
    step.engine = engine  # type: ignore[attr-defined]
    return step
