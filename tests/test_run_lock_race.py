"""The run-folder lock against races, stepped through deterministically (commands/run_lock.py).

Two `train` runs into a folder an earlier run had used were seen to both take it (1 of 5).
Between processes the kernel's `flock` decides; here process A is stopped at each system call
of its attempt in turn (opening, writing, linking, locking, recording), process B makes its
whole attempt meanwhile, then A goes on: at every point exactly one of them holds the
folder, the lock file names it, and the other's refusal names it or says the folder is
being taken over (it used to name the ended run's pid, read before the new holder wrote
its own). Within one process `flock` does not separate two runs: a second run from another
thread used to take a held folder silently, and the end of one run let go of every run's
lock; both are refused / kept now. Sixteen processes started together (a barrier) have one
winner, too.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from superoffload.commands import run_lock
from superoffload.commands.train_args import UsageError

FORK = multiprocessing.get_context("fork")
CALLS = ("open", "write", "link", "unlink", "close", "pwrite", "ftruncate")
DEAD_PID = 4194303  # above Linux's pid_max default (4194304 is the largest it can be set to)


def _attempt(folder: str, conn: Any, pause_at: int | None) -> None:
    """A child: try the lock, stopping before its `pause_at`-th system call until told to go
    on; report ("won"|"lost", message, calls made) and hold on until told to exit."""
    state = {"calls": 0, "active": False}

    def stop() -> None:
        state["active"] = False  # the pipe's own calls are not counted
        conn.send(("paused", "", state["calls"]))
        conn.recv()
        state["active"] = True

    def counted(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if state["active"]:
                state["calls"] += 1
                if state["calls"] == pause_at:
                    stop()
            return real(*args, **kwargs)
        return call

    for name in CALLS:
        setattr(os, name, counted(getattr(os, name)))
    fcntl.flock = counted(fcntl.flock)  # type: ignore[assignment]
    state["active"] = True
    try:
        run_lock.lock_run_folder(Path(folder), "--out run")
        result = ("won", "", state["calls"])
    except UsageError as exc:
        result = ("lost", str(exc), state["calls"])
    state["active"] = False
    conn.send(result)
    conn.recv()  # hold the lock until the test has looked


def _start(folder: Path, pause_at: int | None) -> tuple[Any, Any]:
    ours, theirs = FORK.Pipe()
    proc = FORK.Process(target=_attempt, args=(str(folder), theirs, pause_at), daemon=True)
    proc.start()
    return proc, ours


def _finish(*pairs: tuple[Any, Any]) -> None:
    for proc, conn in pairs:
        if proc.is_alive():
            conn.send("exit")
        proc.join(30)
        assert proc.exitcode == 0


@pytest.mark.parametrize("earlier", [False, True], ids=["new-folder", "earlier-runs-folder"])
def test_two_processes_never_both_hold_a_folder_at_any_interleaving(tmp_path: Path,
                                                                    earlier: bool) -> None:
    points = 0
    for pause_at in range(1, 100):
        folder = tmp_path / f"run-{pause_at}"
        folder.mkdir()
        lock = folder / run_lock.LOCK_NAME
        if earlier:  # an ended run's file: its pid is gone
            lock.write_text(f"{DEAD_PID} {socket.gethostname()}\n")
        a = _start(folder, pause_at)
        kind, _, calls = a[1].recv()
        if kind != "paused":  # A's attempt has fewer system calls: every point was tried
            _finish(a)
            break
        points += 1
        b = _start(folder, None)
        b_result = b[1].recv()
        a[1].send("go")
        a_result = a[1].recv()
        results = {a[0].pid: a_result, b[0].pid: b_result}
        winners = [pid for pid, (kind, _, _) in results.items() if kind == "won"]
        assert len(winners) == 1, (pause_at, results)
        record = lock.read_text().split()
        assert record == [str(winners[0]), socket.gethostname()], (pause_at, record)
        loser = next(msg for kind, msg, _ in results.values() if kind == "lost")
        assert loser.startswith("--out run: another `superoffload train` run ("), loser
        assert str(DEAD_PID) not in loser, (pause_at, loser)  # never the ended run
        assert f"(pid {winners[0]})" in loser or "taking the folder over" in loser, loser
        _finish(a, b)
    assert points >= 5  # the attempt was stopped at each of its system calls in turn


def test_sixteen_processes_started_together_have_one_winner(tmp_path: Path) -> None:
    for trial, earlier in enumerate((False, True, False, True)):
        folder = tmp_path / f"run-{trial}"
        folder.mkdir()
        if earlier:
            (folder / run_lock.LOCK_NAME).write_text(f"{DEAD_PID} {socket.gethostname()}\n")
        pairs = [_start(folder, None) for _ in range(16)]
        kinds = [conn.recv()[0] for _, conn in pairs]
        assert kinds.count("won") == 1, kinds
        _finish(*pairs)


def test_a_second_run_in_this_process_is_refused_and_each_run_releases_its_own(
        tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    errors: list[BaseException] = []
    took_second, release_second = threading.Event(), threading.Event()

    def other_run() -> None:  # a second run from a thread (a notebook cell, a server)
        try:
            with pytest.raises(UsageError, match=rf"--out {first}: another `superoffload "
                               r"train` run in this process \(pid \d+, another thread\)"):
                run_lock.lock_run_folder(first, f"--out {first}")
            run_lock.lock_run_folder(second, f"--out {second}")
            took_second.set()
            release_second.wait(30)
            run_lock.release_all()
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)
            took_second.set()

    run_lock.lock_run_folder(first, f"--out {first}")
    run_lock.lock_run_folder(first, f"--out {first}")  # this run again: re-entrant
    thread = threading.Thread(target=other_run)
    thread.start()
    try:
        assert took_second.wait(30)
        run_lock.release_all()  # the first run ends: its folder only
        fd = os.open(second / run_lock.LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the second run's lock is still held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        a = _start(first, None)  # the first folder is free for another process
        assert a[1].recv()[0] == "won"
        _finish(a)
    finally:
        release_second.set()
        thread.join(30)
        run_lock.release_all()
    assert not errors, errors
