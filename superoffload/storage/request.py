"""One asynchronous transfer between a tensor and a tier file, and what its end means
(docs/storage.md, "I/O engine").

An ``IoRequest`` is split into parts, one per submitter thread it went to
(storage/aio.py); it is done when every part is. Its outcome is decided here, in one place
for every backend: a failed block becomes a ``StorageError`` naming the file, the offset and
the errno; a read that met the end of the file is an error (the file was truncated), never
zeros; a file deleted while the request ran fails it too (``TierFile.check``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from superoffload.storage.files import TierFile
from superoffload.storage.io_errors import StorageError
from superoffload.storage.ring import RingCompletion, RingOp


class IoRequest:
    """A read or write in flight. ``wait`` raises its error in the caller; ``done`` says
    whether it finished. Holds the tensor until then: its memory is being transferred."""

    def __init__(self, file: TierFile, offset_bytes: int, tensor: torch.Tensor, *,
                 is_write: bool, parts: int, on_finish: Callable[[IoRequest], None]) -> None:
        self.file = file
        self.offset_bytes = offset_bytes
        self.nbytes = tensor.numel() * tensor.element_size()
        self.is_write = is_write
        self.done_bytes = 0
        self.error: StorageError | None = None
        self.observed = False
        """True once ``wait`` reported the outcome to a caller."""
        self.tensor: torch.Tensor | None = tensor
        self._parts_left = parts
        self._lock = threading.Lock()
        self._future: Future[None] = Future()
        self._on_finish = on_finish
        if parts == 0:
            self._finish()

    @property
    def verb(self) -> str:
        return "write" if self.is_write else "read"

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the transfer finished; raises its StorageError, or TimeoutError after
        ``timeout_s`` (the request keeps running)."""
        try:
            self._future.result(timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"{self.verb} of {self.nbytes} bytes at offset "
                               f"{self.offset_bytes} of {self.file.path} not finished after "
                               f"{timeout_s} s") from None
        finally:
            if self._future.done():
                self.observed = True

    def settle(self) -> StorageError | None:
        """Block until the transfer finished; its error, without raising it (for closing a
        file: the caller that submitted the request still gets the error from ``wait``)."""
        exc = self._future.exception()
        return exc if isinstance(exc, StorageError) else None

    def part_finished(self, op: RingOp, outcome: RingCompletion | BaseException) -> None:
        """A submitter reports one part (from its thread): its completion, or the exception
        that stopped the submitter."""
        error = self._error_of(op, outcome)
        with self._lock:
            if isinstance(outcome, RingCompletion):
                self.done_bytes += outcome.done_bytes
            if error is not None and (
                    self.error is None
                    or (error.offset_bytes or 0) < (self.error.offset_bytes or 0)):
                # the failure nearest the start of the request
                self.error = error
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        if self.error is None:
            try:
                # deleted or truncated while it ran
                self.file.check()
            except StorageError as exc:
                self.error = exc
        self.tensor = None
        self._on_finish(self)
        if self.error is not None:
            self._future.set_exception(self.error)
        else:
            self._future.set_result(None)

    def _error_of(self, op: RingOp,
                  outcome: RingCompletion | BaseException) -> StorageError | None:
        where = (f"{self.verb} of {self.nbytes} bytes at offset {self.offset_bytes} of tier "
                 f"file {self.file.path}")
        if isinstance(outcome, BaseException):
            code = getattr(outcome, "errno", None) or errno.EIO
            error = StorageError(code, f"{where}: the I/O thread failed: {outcome!r}",
                                 path=self.file.path, offset_bytes=op.offset_bytes)
            error.__cause__ = outcome
            return error
        if outcome.errno:
            return StorageError(outcome.errno, f"{where} failed at offset "
                                f"{outcome.error_offset}: {os.strerror(outcome.errno)}",
                                path=self.file.path, offset_bytes=outcome.error_offset)
        if outcome.end_of_file:
            try:
                # say "deleted" or "truncated" when that is why
                self.file.check()
            except StorageError as exc:
                return StorageError(exc.errno or errno.EIO, f"{where}: {exc.strerror}",
                                    path=self.file.path, offset_bytes=outcome.error_offset)
            ended = "read met the end of the file"
            # transfers retry short counts, so only a 0-byte transfer gets here
            if self.is_write:
                ended = "write transferred nothing"
            return StorageError(errno.EIO, f"{where}: the {ended} at offset "
                                f"{outcome.error_offset} (the file is shorter than the "
                                "engine allocated it)", path=self.file.path,
                                offset_bytes=outcome.error_offset)
        # a ring that lost bytes must not pass silently
        if outcome.done_bytes != op.nbytes:
            return StorageError(errno.EIO, f"{where}: the ring moved {outcome.done_bytes} of "
                                f"the {op.nbytes} bytes at offset {op.offset_bytes} and "
                                "reported no error", path=self.file.path,
                                offset_bytes=op.offset_bytes)
        return None


@dataclass(frozen=True, slots=True)
class Part:
    """The piece of a request one submitter carries."""

    request: IoRequest
    op: RingOp
