"""One `train` run per run folder at a time (docs/failure_semantics.md, "Command line").

Two runs started at once with the same new ``--out`` both found the folder empty, both
trained, and each overwrote the other's checkpoints and ``result.json``. The run folder now
carries a lock: ``<folder>/.superoffload-run.lock``, an exclusive ``flock`` held for the
whole run. The kernel drops a ``flock`` when its process ends, however it ends (SIGKILL
included), so a crashed run never leaves a stale lock: the next run takes the file over.

The file holds the holder's pid and host, written before the file appears under its name
(a temporary linked into place), so a refused run always reads whom it yields to. Within
one process the lock is re-entrant (a resumed run in the same Python session, the tests):
``release_all`` lets go of every lock this process holds.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from superoffload.commands.train_args import UsageError

try:  # POSIX; elsewhere runs are not locked (said in the docs)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".superoffload-run.lock"
"""The lock file inside a run folder (a name starting with ``train_args.OWN_PREFIX``, which
the emptiness check of ``--out`` ignores)."""

_held: dict[str, int] = {}
"""Real path of a locked folder -> the descriptor holding its lock (this process)."""


def _record() -> bytes:
    return f"{os.getpid()} {socket.gethostname()}\n".encode()


def _holder(lock: Path) -> str:
    """"pid 1234" (and the host when it is another one), read from the lock file."""
    try:
        pid, _, host = lock.read_text().strip().partition(" ")
    except OSError:
        return "pid unknown"
    where = f" on host {host}" if host and host != socket.gethostname() else ""
    return f"pid {pid or 'unknown'}{where}"


def lock_run_folder(folder: Path, what: str) -> None:
    """Take ``folder``'s lock for this process, or raise UsageError naming ``what`` (the
    option that chose the folder, e.g. "--out runs/a"), the folder and the other run's pid."""
    if fcntl is None:
        return
    key = os.path.realpath(folder)
    if key in _held:
        return
    lock = Path(key) / LOCK_NAME
    fd = _create(lock)
    if fd is None:  # the file exists: its holder may be alive
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"{what}: another `superoffload train` run ({_holder(lock)}) is using the run "
                f"folder {folder} now; wait for it to end, or choose another --out") from None
        record = _record()  # the previous holder ended: the file is ours now
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
    _held[key] = fd


def _create(lock: Path) -> int | None:
    """A new lock file, locked, with our record in it from the moment it has its name; None
    when one exists already."""
    tmp = lock.with_name(f"{LOCK_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, _record())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        os.link(tmp, lock)  # atomic, and fails when the name exists
        return fd
    except FileExistsError:
        os.close(fd)
        return None
    except OSError:  # a file system without hard links: create the name itself
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
    """Let go of every run-folder lock this process holds (the end of a run)."""
    while _held:
        _, fd = _held.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the descriptor drops its flock
