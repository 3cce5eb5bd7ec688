"""One `train` run per run folder at a time (docs/failure_semantics.md, "Command line").

Two runs started at once with the same new ``--out`` both found the folder empty, both
trained, and each overwrote the other's checkpoints and ``result.json``. The run folder now
carries a lock: ``<folder>/.superoffload-run.lock``, an exclusive ``flock`` held for the
whole run. The kernel drops a ``flock`` when its process ends, however it ends (SIGKILL
included), so a crashed run never leaves a stale lock: the next run takes the file over.

The file holds the holder's pid and host, written before the file appears under its name
(a temporary linked into place); a run taking over a dead run's file writes its own once it
holds the lock, and a run refused in between is told the folder is being taken over, not
the dead pid. Between processes the kernel's ``flock`` decides, so two runs never both hold
a folder, at any interleaving of their steps (tests/test_run_lock_race.py steps through
each). Within one process, ``flock`` would let a second run through: the lock is
re-entrant for the thread that holds it (its own run) and refused to any other thread (a
second run started from a notebook or a thread while the first trains used to take the
folder silently), and ``release_all`` lets go of the calling thread's locks only (it used to
drop every run's lock in the process).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

from superoffload.commands.train_args import UsageError

try:
    # POSIX; elsewhere runs are not locked (said in the docs)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".superoffload-run.lock"
"""The lock file inside a run folder (a name starting with ``train_args.OWN_PREFIX``, which
the emptiness check of ``--out`` ignores)."""

_held: dict[str, tuple[int, int]] = {}
"""Real path of a locked folder -> (the descriptor holding its lock, the thread whose run
took it), in this process."""
# a folder is looked up and taken in one step
_held_guard = threading.Lock()


def _record() -> bytes:
    return f"{os.getpid()} {socket.gethostname()}\n".encode()


def _holder(lock: Path) -> str:
    """"pid 1234" (and the host when it is another one), read from the lock file; a pid of
    this host that is gone is the previous run's, read before the new holder wrote its own."""
    try:
        # the first line: a takeover writes its record over the old one, then truncates
        pid, _, host = lock.read_text().split("\n", 1)[0].strip().partition(" ")
    except OSError:
        return "pid unknown"
    if host and host != socket.gethostname():
        return f"pid {pid or 'unknown'} on host {host}"
    if not pid.isdigit() or not _alive(int(pid)):
        return "taking the folder over from an ended run now"
    return f"pid {pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # alive, another user's
        return True
    return True


def lock_run_folder(folder: Path, what: str) -> None:
    """Take ``folder``'s lock for this process, or raise UsageError naming ``what`` (the
    option that chose the folder, e.g. "--out runs/a"), the folder and the other run's pid."""
    if fcntl is None:
        return
    key = os.path.realpath(folder)
    with _held_guard:
        held = _held.get(key)
        if held is not None and held[1] != threading.get_ident():
            raise UsageError(
                f"{what}: another `superoffload train` run in this process (pid "
                f"{os.getpid()}, another thread) is using the run folder {folder} now; wait "
                "for it to end, or choose another --out")
        if held is None:
            _held[key] = (_take(Path(key) / LOCK_NAME, folder, what), threading.get_ident())


def _take(lock: Path, folder: Path, what: str) -> int:
    """The descriptor holding ``lock``'s ``flock``, or UsageError naming the holder."""
    fd = _create(lock)
    # the file exists: its holder may be alive
    if fd is None:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"{what}: another `superoffload train` run ({_holder(lock)}) is using the run "
                f"folder {folder} now; wait for it to end, or choose another --out") from None
        # the previous holder ended: the file is ours now
        record = _record()
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
    return fd


def _create(lock: Path) -> int | None:
    """A new lock file, locked, with our record in it from the moment it has its name; None
    when one exists already."""
    tmp = lock.with_name(f"{LOCK_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, _record())
        # a new file: nobody else has it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # atomic, and fails when the name exists
        os.link(tmp, lock)
        return fd
    except FileExistsError:
        os.close(fd)
        return None
    except OSError:
        # a file system without hard links: create the name itself
        os.close(fd)
        return _create_in_place(lock)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_in_place(lock: Path) -> int | None:
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, _record())
    return fd


def release_all() -> None:
    """Let go of every run-folder lock the calling thread's run holds (the end of a run)."""
    me = threading.get_ident()
    with _held_guard:
        mine = [key for key, (_, thread) in _held.items() if thread == me]
        for key in mine:
            fd, _ = _held.pop(key)
            with contextlib.suppress(OSError):
                # closing the descriptor drops its flock
                os.close(fd)
