"""What the storage tier raises and warns (docs/storage.md, "I/O engine").

Every failure of a tier file is a ``StorageError``: an ``OSError`` whose ``errno`` is the
kernel's (or EIO for a short read, ENOENT for a deleted file), whose ``filename`` is the tier
file, and whose ``offset_bytes`` says where in it the failure was (None when the failure is
about the whole file: opening, allocating, the folder).
"""

from __future__ import annotations

import errno as errno_codes
import os


class StorageError(OSError):
    """A tier file could not be opened, allocated, read or written; the message names the
    file, the offset and what to do."""

    def __init__(self, code: int, message: str, *, path: str | os.PathLike[str],
                 offset_bytes: int | None = None) -> None:
        super().__init__(code, message)
        self.filename = os.fspath(path)
        self.offset_bytes = offset_bytes

    def __str__(self) -> str:
        name = errno_codes.errorcode.get(self.errno or 0, str(self.errno))
        return f"{self.strerror} [{name}]"

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # OSError pickles its args only; keep the keywords so a worker's error crosses
        # processes intact
        return (_rebuild, (self.errno, self.strerror, self.filename, self.offset_bytes))


def _rebuild(code: int, message: str, path: str, offset_bytes: int | None) -> StorageError:
    return StorageError(code, message, path=path, offset_bytes=offset_bytes)


class StorageWarning(RuntimeWarning):
    """The engine runs slower than asked: buffered instead of O_DIRECT, or the torch-only
    fallback instead of the C engine. Said once per cause."""
