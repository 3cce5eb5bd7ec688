"""The engine's error types: one family for both transports (single process and ZeRO).

Every failure that happens on a lane (a transfer, the CPU optimizer, a collective) is
stored by the engine and raised in the training thread at its next call as an
``EngineError`` (``superoffload.distributed.process_group.DistributedError`` is one, for a failed
collective), so ``except EngineError`` catches what the engine can raise from any thread.
"""

from __future__ import annotations

import threading


class EngineError(RuntimeError):
    """A failure of the offload engine, raised in the training thread."""


class WatchdogTimeout(EngineError):
    """A bucket stayed in flight longer than ``OffloadConfig.watchdog_s``."""


class EngineClosed(EngineError):
    """The engine was closed (or failed and was shut down); build a new one."""


class IterationInterrupted(EngineError):
    """An iteration was interrupted midway (an exception or Ctrl-C in backward/step) and the
    engine could not undo it; the message says how to recover."""


class FailureBox:
    """The first failure of any lane, raised in the training thread (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.failed = False
        """A lane failed (a plain attribute: every engine call and forward reads it)."""
        self.lane = ""
        self.reported = False
        """True once the failure reached the user (raised from an engine call)."""

    def record(self, lane: str, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error, self.lane, self.failed = exc, lane, True

    def raise_if_failed(self) -> None:
        """Raise the stored failure as an EngineError (the original as its cause)."""
        exc = self.error
        if exc is None:
            return
        self.reported = True
        if isinstance(exc, EngineError):
            # keep the type (DistributedError, WatchdogTimeout) so callers can tell them apart
            raise type(exc)(f"{exc} (on the engine's {self.lane} lane)") from exc
        raise EngineError(f"the engine's {self.lane} lane failed: {exc!r}") from exc
