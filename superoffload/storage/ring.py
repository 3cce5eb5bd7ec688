"""A ring: what one submitter thread drives (docs/storage.md, "I/O engine").

A ring takes requests (``RingOp``: a file range to or from one buffer), cuts each into
blocks of at most ``block_bytes``, keeps up to ``queue_depth`` blocks in flight and reports
each request once it finished (``RingCompletion``). Two implementations share this
interface: the C engine over io_uring or Linux AIO (storage/aio_c.py) and the torch-only
fallback, a small thread pool (storage/aio_threads.py). Only the thread that created a ring
calls it, except ``wake``.

``open_ring`` picks the backend: "auto" tries io_uring, then libaio, then the threads, and
says once when it ends on the threads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from superoffload.storage.io_errors import StorageWarning

BACKENDS = ("io_uring", "libaio", "threads")
"""Every backend, the fastest first: the order "auto" tries them in."""

ALIGN_BYTES = 4096
"""O_DIRECT's unit here: file offsets, memory addresses and lengths are multiples of it
(the page size, a multiple of every logical block size Linux drives use)."""


@dataclass(frozen=True, slots=True)
class RingOp:
    fd_direct: int
    """The file opened with O_DIRECT, or -1 (every block goes through the page cache)."""
    fd_buffered: int
    is_write: bool
    addr: int
    """Address of the first byte of the buffer (a tensor's data_ptr)."""
    offset_bytes: int
    nbytes: int
    tag: int
    """The submitter's id of the request, given back in its completion."""


@dataclass(frozen=True, slots=True)
class RingCompletion:
    tag: int
    done_bytes: int
    errno: int
    """0, or the errno of the first block that failed."""
    end_of_file: bool
    """A read met the end of the file (or a write transferred nothing): the file is shorter
    than the request, never silently zero-filled."""
    error_offset: int
    """File offset of the block that failed; -1 when none did."""


class Ring(Protocol):
    backend: str

    def submit(self, op: RingOp) -> None: ...

    def run(self, timeout_ms: int = -1) -> list[RingCompletion]:
        """Issue blocks, wait until a request finished, ``wake`` was called or nothing is
        in flight; the finished requests."""
        ...

    def wake(self) -> None:
        """Make a ``run`` blocked in another thread return; callable from any thread."""
        ...

    def close(self) -> None:
        """Wait for every block in flight, then free the ring."""
        ...


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says why."""


def c_engine() -> ModuleType:
    """storage/aio_c.py, or BackendUnavailable saying why it cannot load. A stale build
    (ABI version mismatch) raises ImportError: it must be rebuilt, not bypassed."""
    try:
        from superoffload.storage import aio_c
    except ImportError as exc:
        if "is not built" in str(exc):
            raise BackendUnavailable(str(exc)) from exc
        raise
    return aio_c


def available_backends() -> tuple[str, ...]:
    """The backends that run here (compiled in and allowed by the kernel), fastest first;
    "threads" always."""
    out = []
    for name in BACKENDS[:-1]:
        try:
            ring = c_engine().CRing(name, queue_depth=1, max_requests=1, block_bytes=ALIGN_BYTES,
                                    align_bytes=ALIGN_BYTES)
        except BackendUnavailable:
            continue
        ring.close()
        out.append(name)
    return (*out, "threads")


def open_ring(backend: str, *, queue_depth: int, max_requests: int,
              block_bytes: int) -> Ring:
    """A ring of ``backend`` ("auto" or one of ``BACKENDS``); BackendUnavailable when a
    named backend cannot run here."""
    from superoffload.storage.aio_threads import ThreadRing

    if backend == "threads":
        return ThreadRing(queue_depth=queue_depth, max_requests=max_requests,
                          block_bytes=block_bytes, align_bytes=ALIGN_BYTES)
    reasons = []
    for name in (BACKENDS[:-1] if backend == "auto" else (backend,)):
        try:
            return c_engine().CRing(name, queue_depth=queue_depth, max_requests=max_requests,
                                    block_bytes=block_bytes, align_bytes=ALIGN_BYTES)
        except BackendUnavailable as exc:
            reasons.append(f"{name}: {exc}")
    if backend != "auto":
        raise BackendUnavailable(f"backend={backend!r} cannot run here ({reasons[0]}); use "
                                 "backend='auto' to take the best available")
    warnings.warn("superoffload's I/O engine uses the torch-only fallback (a thread pool, "
                  f"slower): {'; '.join(reasons)}", StorageWarning, stacklevel=3)
    return ThreadRing(queue_depth=queue_depth, max_requests=max_requests,
                      block_bytes=block_bytes, align_bytes=ALIGN_BYTES)
