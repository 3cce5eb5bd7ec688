"""The asynchronous I/O engine of the storage tier (DESIGN.md §7, "I/O is a lane";
docs/storage.md, "I/O engine").

    engine = AioEngine(queue_depth=32, block_bytes=1 << 20, thread_count=1)
    file = engine.open("/nvme/so/state-0.bin", size_bytes)   # allocated in full, now
    buf = aligned_empty(n, pin=True)                          # storage/aligned.py
    req = engine.write(file, 0, buf)                          # returns at once
    req.wait()                                                # raises StorageError
    engine.fsync(file); engine.close()

Requests are split among ``thread_count`` submitters (storage/submitter.py: DeepSpeed's
``aio.thread_count``, parallel submitting threads), each keeping up to ``queue_depth``
blocks of ``block_bytes`` in flight on its ring (storage/ring.py: io_uring, Linux AIO or
the torch-only thread pool). ``read``/``write`` may be called from several threads at once.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from dataclasses import dataclass

import torch

from superoffload.storage.files import DIRECT_MODES, DirectVerdicts, TierFile, open_tier_file
from superoffload.storage.io_errors import StorageError
from superoffload.storage.request import IoRequest, Part
from superoffload.storage.ring import ALIGN_BYTES, BACKENDS, RingOp, open_ring
from superoffload.storage.submitter import Submitter

MAX_REQUESTS_PER_RING = 256
"""Requests a ring holds at once; more wait in their submitter's queue."""


@dataclass(frozen=True, slots=True)
class IoCounters:
    """What the engine moved since it was made (telemetry's storage lane)."""

    bytes_read: int
    bytes_written: int
    reads: int
    writes: int
    busy_s: float
    """Wall time with at least one request in flight."""


def split_request(nbytes: int, block_bytes: int, submitters: int) -> list[tuple[int, int]]:
    """(start within the request, bytes) of each part: at most ``submitters`` contiguous
    parts of whole blocks, so a large request keeps every submitter busy (DeepSpeed's
    ``thread_count``: parallel submitters, each on its share of a request) and a small one
    goes to one."""
    if nbytes == 0:
        return []
    blocks = -(-nbytes // block_bytes)
    per_part = -(-blocks // submitters) * block_bytes
    return [(start, min(per_part, nbytes - start)) for start in range(0, nbytes, per_part)]


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"AioEngine: {name}={value!r} must be an int in [{low}, {high}]")
    return value


class AioEngine:
    """Asynchronous reads and writes between CPU tensors and tier files; a context manager.

    ``backend``: "auto" (io_uring, else libaio, else threads; says so once when it ends on
    the threads), or one of ``BACKENDS`` (an error when it cannot run here). ``direct``:
    "auto" (O_DIRECT where the file system takes it, buffered elsewhere, said once per file
    system), "on" (an error where it does not) or "off"."""

    def __init__(self, *, queue_depth: int = 32, block_bytes: int = 1 << 20,
                 thread_count: int = 1, direct: str = "auto", backend: str = "auto") -> None:
        self.queue_depth = _check_int("queue_depth", queue_depth, 1, 4096)
        self.block_bytes = _check_int("block_bytes", block_bytes, ALIGN_BYTES, 1 << 30)
        if block_bytes % ALIGN_BYTES:
            raise ValueError(f"AioEngine: block_bytes={block_bytes} must be a multiple of "
                             f"{ALIGN_BYTES} (O_DIRECT's alignment); e.g. {1 << 20}")
        self.thread_count = _check_int("thread_count", thread_count, 1, 64)
        if direct not in DIRECT_MODES:
            raise ValueError(f"AioEngine: direct={direct!r} must be one of {DIRECT_MODES}")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"AioEngine: backend={backend!r} must be 'auto' or one of "
                             f"{BACKENDS}")
        self.direct = direct
        self._verdicts: DirectVerdicts = {}
        self._lock = threading.Lock()
        self._files: dict[int, TierFile] = {}
        self._outstanding: dict[int, set[IoRequest]] = {}
        self._unobserved: list[IoRequest] = []
        self._next_submitter = itertools.count()
        self._closed = False
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        # is_write -> [bytes, requests]
        self._moved = {True: [0, 0], False: [0, 0]}
        self._submitters: list[Submitter] = []
        try:
            for i in range(thread_count):
                # every submitter runs the backend the first one got
                ring = open_ring(backend if i == 0 else self.backend,
                                 queue_depth=queue_depth, max_requests=MAX_REQUESTS_PER_RING,
                                 block_bytes=block_bytes)
                self.backend: str = ring.backend
                self._submitters.append(Submitter(ring, f"superoffload-aio-{i}",
                                                  MAX_REQUESTS_PER_RING))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ files
    def open(self, path: str | os.PathLike[str], size_bytes: int, *,
             create: bool = True) -> TierFile:
        """Open (``create``: make if missing) the tier file and allocate it in full now: a
        full disk or a read-only folder fails here, naming the folder."""
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 1:
            raise ValueError(f"AioEngine.open: size_bytes={size_bytes!r} must be a positive "
                             "int")
        self._check_open()
        file = open_tier_file(path, size_bytes, create=create, direct=self.direct,
                              verdicts=self._verdicts)
        with self._lock:
            self._files[id(file)] = file
            self._outstanding[id(file)] = set()
        return file

    def fsync(self, file: TierFile) -> None:
        """Wait for the file's writes submitted so far (raising their errors), then make
        them durable (fsync: the data and the file's size reach stable storage, device
        cache included)."""
        self._check_file(file)
        with self._lock:
            writes = [r for r in self._outstanding[id(file)] if r.is_write]
        for request in writes:
            request.wait()
        try:
            os.fsync(file.fd_buffered)
        except OSError as exc:
            raise StorageError(exc.errno or errno.EIO, f"fsync of tier file {file.path}: "
                               f"{exc.strerror}", path=file.path) from exc

    def close_file(self, file: TierFile) -> None:
        """Wait for the file's requests, then close it (the file stays on disk)."""
        self._check_file(file)
        with self._lock:
            pending = list(self._outstanding[id(file)])
        for request in pending:
            request.settle()
        with self._lock:
            self._files.pop(id(file), None)
            self._outstanding.pop(id(file), None)
        file.close()

    # ------------------------------------------------------------------ transfers
    def read(self, file: TierFile, offset_bytes: int, tensor: torch.Tensor) -> IoRequest:
        """Fill ``tensor``'s bytes from ``file`` at ``offset_bytes``; returns at once."""
        return self._submit(file, offset_bytes, tensor, is_write=False)

    def write(self, file: TierFile, offset_bytes: int, tensor: torch.Tensor) -> IoRequest:
        """Write ``tensor``'s bytes to ``file`` at ``offset_bytes``; returns at once. The
        tensor must not change until the request is done."""
        return self._submit(file, offset_bytes, tensor, is_write=True)

    def _submit(self, file: TierFile, offset_bytes: int, tensor: torch.Tensor, *,
                is_write: bool) -> IoRequest:
        verb = "write" if is_write else "read"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"AioEngine.{verb}: tensor must be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"AioEngine.{verb}: tensor must be a contiguous CPU tensor (got "
                             f"device={tensor.device}, contiguous={tensor.is_contiguous()}); "
                             "use .contiguous() or a buffer from aligned_empty()")
        nbytes = tensor.numel() * tensor.element_size()
        if isinstance(offset_bytes, bool) or not isinstance(offset_bytes, int) \
                or offset_bytes < 0 or offset_bytes + nbytes > file.size_bytes:
            raise ValueError(f"AioEngine.{verb}: offset_bytes={offset_bytes!r} with "
                             f"{nbytes} bytes must lie within the file's {file.size_bytes} "
                             f"bytes ({file.path})")
        self._check_file(file)
        # deleted or truncated: fail before anything moves
        file.check()
        parts = split_request(nbytes, self.block_bytes, len(self._submitters))
        request = IoRequest(file, offset_bytes, tensor, is_write=is_write, parts=len(parts),
                            on_finish=self._finished)
        if not parts:
            return request
        with self._lock:
            self._outstanding[id(file)].add(request)
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1
        start = next(self._next_submitter)
        for i, (start_bytes, part_bytes) in enumerate(parts):
            submitter = self._submitters[(start + i) % len(self._submitters)]
            op = RingOp(fd_direct=file.fd_direct, fd_buffered=file.fd_buffered,
                        is_write=is_write, addr=tensor.data_ptr() + start_bytes,
                        offset_bytes=offset_bytes + start_bytes, nbytes=part_bytes,
                        tag=submitter.next_tag())
            try:
                submitter.put(Part(request, op))
            except StorageError as exc:
                # this part failed, and so do the parts not yet put: the request must count
                # every part finished or its waiter never wakes
                request.part_finished(op, exc)
                for _ in parts[i + 1:]:
                    request.part_finished(op, exc)
                break
        return request

    def _finished(self, request: IoRequest) -> None:
        # called by the submitter thread that finished the request's last part
        with self._lock:
            moved = self._moved[request.is_write]
            moved[0] += request.done_bytes
            moved[1] += 1
            self._outstanding.get(id(request.file), set()).discard(request)
            if request.nbytes == 0:
                return
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += time.monotonic() - self._busy_since
            if request.error is not None:
                self._unobserved.append(request)

    def counters(self) -> IoCounters:
        with self._lock:
            busy = self._busy_s
            # the busy stretch still open counts up to now, so a poll mid-transfer sees it
            if self._in_flight:
                busy += time.monotonic() - self._busy_since
            return IoCounters(bytes_read=self._moved[False][0],
                              bytes_written=self._moved[True][0], reads=self._moved[False][1],
                              writes=self._moved[True][1], busy_s=busy)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for every request in flight (the kernel writes into their buffers until
        then), stop the submitters, close the files. Idempotent. Raises the first error of
        a failed request nobody waited for, so no failure goes unseen."""
        unseen = self._shutdown()
        if unseen is not None:
            raise unseen

    def _shutdown(self) -> StorageError | None:
        with self._lock:
            if self._closed:
                return None
            self._closed = True
        for submitter in self._submitters:
            submitter.close()
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
            unseen = [r for r in self._unobserved if not r.observed]
        for file in files:
            file.close()
        return unseen[0].error if unseen else None

    def __enter__(self) -> AioEngine:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        unseen = self._shutdown()
        # never mask the exception leaving the block
        if unseen is not None and exc is None:
            raise unseen

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("AioEngine is closed; make a new one")

    def _check_file(self, file: TierFile) -> None:
        self._check_open()
        if not isinstance(file, TierFile) or id(file) not in self._files:
            raise ValueError(f"AioEngine: {file!r} is not a file this engine opened (or it "
                             "was closed); use engine.open(...)")
