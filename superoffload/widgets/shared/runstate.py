"""The states of a training run as the widgets show them (one vocabulary for all views)."""

from __future__ import annotations

from enum import Enum


class RunState(str, Enum):
    """Where a run stands. `BackgroundTrainer` sets it; the dashboard and the tuner show it."""

    NOT_STARTED = "not started"
    RUNNING = "running"
    FINISHED = "finished"
    """Ran every step it was asked for (or its time limit)."""
    STOPPED = "stopped"
    """Stopped early by the user (the Stop button or `trainer.stop()`)."""
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (RunState.FINISHED, RunState.STOPPED, RunState.FAILED)
