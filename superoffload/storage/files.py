"""Tier files: opened, allocated in full, O_DIRECT where the file system takes it, and
checked for deletion and truncation (docs/storage.md, "I/O engine").

``open_tier_file`` allocates the whole file up front (posix_fallocate), so a full disk fails
when the file is opened, naming the folder, the bytes needed and the bytes free, never in
the middle of a run. Each file is opened twice: buffered, and with O_DIRECT when the file
system takes it (decided once per file system by reading the first 4 KiB of the file with
O_DIRECT; tmpfs before Linux 6.6, ramfs and some FUSE file systems answer EINVAL), so a
ring can send each block the way its alignment allows (storage/ring.py).
"""

from __future__ import annotations

import errno
import mmap
import os
import warnings
from pathlib import Path

from superoffload.storage.io_errors import StorageError, StorageWarning
from superoffload.storage.ring import ALIGN_BYTES

DIRECT_MODES = ("auto", "on", "off")

DirectVerdicts = dict[int, str | None]
"""Per file system (``st_dev``): None when O_DIRECT works there, else why it does not."""


def allocated_bytes(size_bytes: int) -> int:
    """The file's size on disk: ``size_bytes`` rounded up to ``ALIGN_BYTES``, so an aligned
    block never reaches past the end of the file."""
    return -(-size_bytes // ALIGN_BYTES) * ALIGN_BYTES


class TierFile:
    """One file of the storage tier, opened by ``AioEngine.open``. ``size_bytes`` is what
    the caller asked for; the file holds ``allocated_bytes``."""

    def __init__(self, path: Path, size_bytes: int, fd_buffered: int, fd_direct: int) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.allocated_bytes = allocated_bytes(size_bytes)
        self.fd_buffered = fd_buffered
        self.fd_direct = fd_direct
        """-1 when the file system refused O_DIRECT or the engine was told not to use it."""
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether aligned blocks of this file bypass the page cache (O_DIRECT)."""
        return self.fd_direct >= 0

    def check(self) -> None:
        """Raise StorageError when the file was deleted or truncated under the engine.
        One fstat (about a microsecond), made when a request is submitted and when it
        completes: a request moves at least a few KiB, so the check costs nothing next to
        it, and a write that landed in a deleted file is reported by its own wait()."""
        if self.closed:
            raise StorageError(errno.EBADF, f"tier file {self.path} is closed",
                               path=self.path)
        try:
            st = os.fstat(self.fd_buffered)
        except OSError as exc:
            raise StorageError(exc.errno or errno.EBADF,
                               f"tier file {self.path}: its descriptor is gone "
                               f"({exc.strerror})", path=self.path) from exc
        if st.st_nlink == 0:
            raise StorageError(errno.ENOENT,
                               f"tier file {self.path} was deleted while the engine had it "
                               "open: its data is gone with it (a tier file is scratch, "
                               "owned by the engine; restore from the last checkpoint)",
                               path=self.path)
        if st.st_size < self.allocated_bytes:
            raise StorageError(errno.EIO,
                               f"tier file {self.path} was truncated under the engine to "
                               f"{st.st_size} bytes (allocated {self.allocated_bytes}); "
                               "restore from the last checkpoint", path=self.path)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (self.fd_direct, self.fd_buffered):
            if fd >= 0:
                os.close(fd)


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _open_error(exc: OSError, path: Path, create: bool) -> StorageError:
    folder = path.parent
    code = exc.errno or errno.EIO
    if code == errno.EROFS:
        why = f"the folder {folder} is on a read-only file system"
    elif code in (errno.EACCES, errno.EPERM):
        why = f"the folder {folder} is not writable here ({exc.strerror})"
    elif code == errno.ENOENT and not folder.is_dir():
        why = f"the folder {folder} does not exist (create it first)"
    elif code == errno.ENOENT and not create:
        why = "the file does not exist (open it with create=True)"
    else:
        why = exc.strerror or str(exc)
    return StorageError(code, f"cannot open tier file {path}: {why}", path=path)


def _allocate(fd: int, path: Path, size_bytes: int) -> None:
    need = allocated_bytes(size_bytes)
    try:
        os.posix_fallocate(fd, 0, need)
    except OSError as exc:
        code = exc.errno or errno.EIO
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError(
                code, f"cannot allocate tier file {path}: it needs {need} bytes "
                f"({need / 2**30:.2f} GiB) and the file system of {path.parent} has "
                f"{_free_bytes(path.parent)} bytes free; free space there or choose "
                "another folder", path=path) from exc
        raise StorageError(code, f"cannot allocate {need} bytes for tier file {path}: "
                           f"{exc.strerror}", path=path) from exc


def _probe_direct(path: Path) -> str | None:
    """None when an aligned O_DIRECT read of the file's first block works, else why not
    (EINVAL: the file system takes no O_DIRECT)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        return f"opening with O_DIRECT: {exc.strerror} [{errno.errorcode.get(exc.errno or 0)}]"
    try:
        # page-aligned, as O_DIRECT requires
        with mmap.mmap(-1, ALIGN_BYTES) as page:
            os.preadv(fd, [page], 0)
    except OSError as exc:
        return f"an O_DIRECT read: {exc.strerror} [{errno.errorcode.get(exc.errno or 0)}]"
    finally:
        os.close(fd)
    return None


def _direct_fd(path: Path, fd_buffered: int, direct: str, verdicts: DirectVerdicts) -> int:
    if direct == "off":
        return -1
    device = os.fstat(fd_buffered).st_dev
    if device not in verdicts:
        verdicts[device] = _probe_direct(path)
        if verdicts[device] is not None and direct == "auto":
            # once per file system and engine (the verdict is kept), and Python's warning
            # filter shows an identical message once per process
            warnings.warn(f"the file system of {path.parent} refuses O_DIRECT "
                          f"({verdicts[device]}): tier files there use buffered I/O through "
                          "the page cache", StorageWarning, stacklevel=4)
    why = verdicts[device]
    if why is not None:
        if direct == "on":
            raise StorageError(errno.EINVAL, f"direct='on' but the file system of "
                               f"{path.parent} refuses O_DIRECT ({why}); use direct='auto' "
                               "to fall back to buffered I/O", path=path)
        return -1
    return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)


def open_tier_file(path: str | os.PathLike[str], size_bytes: int, *, create: bool,
                   direct: str, verdicts: DirectVerdicts) -> TierFile:
    """Open (and with ``create`` make) the tier file at ``path`` and allocate it in full.
    Keeps what an existing file holds; a file created here is removed again when the
    allocation fails, so a failed open leaves nothing behind."""
    path = Path(path)
    created = False
    try:
        if create:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _open_error(exc, path, create) from exc
    try:
        if not create and os.fstat(fd).st_size < allocated_bytes(size_bytes):
            raise StorageError(errno.EIO, f"tier file {path} holds {os.fstat(fd).st_size} "
                               f"bytes, fewer than the {allocated_bytes(size_bytes)} asked "
                               "for (truncated?); open it with create=True to start afresh",
                               path=path)
        _allocate(fd, path, size_bytes)
        fd_direct = _direct_fd(path, fd, direct, verdicts)
    except BaseException:
        os.close(fd)
        if created:
            path.unlink(missing_ok=True)
        raise
    return TierFile(path, size_bytes, fd, fd_direct)
