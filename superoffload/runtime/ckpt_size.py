"""How many bytes a checkpoint file takes, and whether the file system takes them
(docs/failure_semantics.md, "A full disk"; ckpt_files.py writes the file).

``torch.save`` writes a zip archive: the pickled structure (``data.pkl``, each tensor a small
rebuild record naming its storage), each storage once as a record of its own, aligned to 64
bytes, and a few small records and the zip directory. ``FileSize.of`` derives two figures
from the payload itself:

* ``lower_bytes``: every storage's bytes plus the pickled structure with each tensor as a
  short reference (shorter than torch's rebuild record): the file cannot be smaller. A save
  is refused before anything is written only when the free space, or the process's file-size
  limit, is below this (a fixed margin used to refuse a 132 kB save into 164 kB free);
* ``estimate_bytes``: that plus the archive's own bytes, measured at 220-280 bytes per
  tensor (zip headers, alignment, the rebuild record) and about 1.3 kB per file, counted
  here at ``TENSOR_RECORD_BYTES`` and ``ARCHIVE_BYTES``: what an error says the file needs.

A write that fails on a full disk or quota says "no space left on device" (``no_space``);
one past ``ulimit -f`` (RLIMIT_FSIZE: the kernel answers EFBIG, Python ignores SIGXFSZ)
names the limit (``file_too_big``); torch.save reports either as "unexpected pos".
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
from dataclasses import dataclass
from typing import Any

import torch

TENSOR_RECORD_BYTES = 512
"""Archive bytes per tensor besides its storage: measured 220-280
(tests/test_checkpoint_save_errors.py)."""
ARCHIVE_BYTES = 4096
"""Archive bytes per file besides its records: measured about 1,300."""
# torch.save's default (torch.serialization.DEFAULT_PROTOCOL)
PICKLE_PROTOCOL = 2


class _Structure(pickle.Pickler):
    """Pickles a payload with each tensor replaced by a short reference, noting storages."""

    def __init__(self, sink: io.BytesIO) -> None:
        super().__init__(sink, protocol=PICKLE_PROTOCOL)
        self.storages: dict[tuple[str, int], int] = {}
        self.tensors = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        # views share one; torch.save writes whole storages
        storage = obj.untyped_storage()
        self.storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        self.tensors += 1
        return self.tensors


@dataclass(frozen=True, slots=True)
class FileSize:
    """The size of the file ``torch.save`` writes for one payload (module docstring)."""

    lower_bytes: int
    estimate_bytes: int

    @classmethod
    def of(cls, payload: Any) -> FileSize:
        sink = io.BytesIO()
        structure = _Structure(sink)
        structure.dump(payload)
        lower = sum(structure.storages.values()) + sink.tell()
        return cls(lower, lower + structure.tensors * TENSOR_RECORD_BYTES + ARCHIVE_BYTES)


def file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (``ulimit -f``), or None."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def check_room(final: str, size: FileSize) -> None:
    """Refuse, before anything is written, a file that cannot fit: the free space reported
    where it goes, or the file-size limit, is below its ``lower_bytes``."""
    try:
        free: int | None = shutil.disk_usage(os.path.dirname(final) or ".").free
    except OSError:  # no statvfs there: find out by writing
        free = None
    if free is not None and free < size.lower_bytes:
        raise no_space(final, size)
    limit = file_size_limit()
    if limit is not None and limit < size.lower_bytes:
        raise file_too_big(final, size, limit)


def write_error(cause: BaseException, final: str, size: FileSize) -> OSError | None:
    """The named error for an OS error that stopped writing ``final``; None for others."""
    if not isinstance(cause, OSError):
        return None
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space(final, size, cause)
    if cause.errno == errno.EFBIG:
        return file_too_big(final, size, file_size_limit(), cause)
    return None


def no_space(final: str, size: FileSize, cause: OSError | None = None) -> OSError:
    """The error of a save that does not fit: "no space left on device", the bytes the file
    needs and the bytes free where it goes."""
    folder = os.path.dirname(final) or "."
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    # the OS's own words, when the error came from a failed write rather than the estimate
    how = ""
    if cause is not None:
        how = f" ({cause.strerror or cause})"
    needed = size.estimate_bytes
    return OSError(errno.ENOSPC, f"no space left on device{how}: writing {final} needs about "
                   f"{needed:,} bytes ({needed / 1e6:.1f} MB), {free}; free some space or save "
                   "the checkpoint elsewhere", final)


def file_too_big(final: str, size: FileSize, limit: int | None,
                 cause: OSError | None = None) -> OSError:
    """The error of a save past the process's file-size limit (RLIMIT_FSIZE)."""
    # the OS's own words, when the error came from a failed write rather than the estimate
    how = ""
    if cause is not None:
        how = f" ({cause.strerror or cause})"
    allowed = "a smaller size" if limit is None else f"{limit:,} bytes"
    needed = size.estimate_bytes
    return OSError(errno.EFBIG, f"file size limit exceeded{how}: writing {final} needs about "
                   f"{needed:,} bytes ({needed / 1e6:.1f} MB), this process may write files of "
                   f"at most {allowed} (ulimit -f, RLIMIT_FSIZE); raise the limit (ulimit -f "
                   "unlimited) before starting the run", final)
