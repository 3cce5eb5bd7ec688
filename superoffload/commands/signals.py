"""SIGINT and SIGTERM during `superoffload train`: stop at the next step boundary while steps
run, at once otherwise, and say so at once (docs/failure_semantics.md, "SIGINT and SIGTERM")."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from superoffload.distributed.process_group import dist_info, exited_peers


def gone_peers_note() -> str:
    """" (rank(s) [1] on this host have exited)" when a local peer of this job has ended, else
    "" (and in a single process): why a launcher may be stopping this rank -- torchrun ends
    the whole job once one rank dies, often before this rank's collective fails and names it."""
    try:
        world = dist_info().world_size
    except RuntimeError:  # not distributed: no peers
        return ""
    gone = exited_peers(list(range(world)))
    if not gone:
        return ""
    return f" (rank(s) {gone} on this host have exited)"


class StopSignals:
    """While steps run (inside ``deferring()``), SIGINT and SIGTERM ask the loop to stop at
    the next step boundary (and write a checkpoint there) instead of killing the process
    mid-iteration. The handler only records the signal; it then restores the previous
    handlers, so a second signal acts at once (a second Ctrl-C raises KeyboardInterrupt).
    Installed only from the main thread.

    When no step runs (setting up, the last step, the final evaluation, the report), there is
    no step boundary to wait for: the signal stops the process at once, with one line and
    exit code 128 + the signal (it used to say "finishing the current step" and live on
    through an evaluation of any length).

    Answered at once: Python runs a signal handler only when the main thread
    returns to Python code, which one long operation (a step on a huge --seq) can delay for
    minutes, and the signal used to wait without a word. So the C-level handler also writes
    the signal's number into a pipe (``signal.set_wakeup_fd``) that a thread reads: within
    milliseconds it prints that the signal was received and what will happen (with
    ``announce``), and when a second signal arrives before the Python handler could run, it
    ends the process itself (exit code 128 + the signal, as a shell reports it)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, announce: bool = True) -> None:
        self.signum = 0
        self.announce = announce
        self._deferring = False
        self._old: dict[int, Any] = {}
        self._old_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
            read_fd, write_fd = os.pipe()
            # the C handler must never block
            os.set_blocking(write_fd, False)
            self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._pipe = (read_fd, write_fd)
            threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                             name="superoffload-signals").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            # the watcher reads end-of-file and closes its end
            os.close(self._pipe[1])
            self._pipe = None

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """The steps: a signal inside waits for the step boundary (``signum``)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._deferring:
            # no step to finish: the watcher thread stops the process
            return
        self.signum = signum
        self.restore()

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _watch(self, read_fd: int) -> None:
        """The watcher thread: one byte per signal that reached a Python-level handler."""
        received = 0
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    if signum not in self.SIGNALS:
                        continue
                    received += 1
                    # the handler records a signal that came while steps ran (the main
                    # thread runs it before it can leave ``deferring()``)
                    if not self._deferring and self.signum == 0:
                        # a launcher's SIGTERM after a rank died: say which rank, as the
                        # collective that would have failed next would (process_group.py)
                        print(f"train: {signal_name(signum)} received while no training step "
                              "runs: stopping now (checkpoints already written are kept)"
                              f"{gone_peers_note()}", file=sys.stderr, flush=True)
                        sys.stdout.flush()
                        os._exit(128 + signum)
                    if received == 1:
                        if self.announce:
                            name = signal_name(signum)
                            print(f"train: {name} received: finishing the current step, then "
                                  f"saving a checkpoint and stopping (send {name} again to stop "
                                  f"at once, without a checkpoint){gone_peers_note()}",
                                  file=sys.stderr, flush=True)
                    # the main thread is still in one long operation
                    elif self.signum == 0:
                        print(f"train: {signal_name(signum)} again: stopping now, without a "
                              f"checkpoint{gone_peers_note()}", file=sys.stderr, flush=True)
                        sys.stdout.flush()
                        os._exit(128 + signum)
        finally:
            os.close(read_fd)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
