"""The torch-only fallback ring: a small thread pool doing ``os.preadv`` / ``os.pwritev``
straight into the tensor's memory (docs/storage.md, "I/O engine").

Same interface and same rules as the C engine (cext/so_aio.c), so both backends cut a
request into the same blocks, use O_DIRECT for the same ones and fail the same way:
``block_length`` and ``use_direct`` mirror its ``carve`` and ``choose_fd``. Up to
``min(queue_depth, MAX_THREADS)`` blocks run at once, one per pool thread; the blocking
system calls release the GIL.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from superoffload.storage.ring import RingCompletion, RingOp

MAX_THREADS = 8
"""Pool threads per ring: past a few, more threads only add contention on 2-16 cores."""


def block_length(offset_bytes: int, left_bytes: int, block_bytes: int,
                 align_bytes: int) -> int:
    """Length of the next block at ``offset_bytes`` with ``left_bytes`` of the request to
    go: the head up to the first aligned offset, then ``block_bytes`` at most, the tail
    shorter than ``align_bytes`` in a block of its own (cext/so_aio.c ``carve``)."""
    if offset_bytes % align_bytes:
        return min(left_bytes, align_bytes - offset_bytes % align_bytes)
    length = min(left_bytes, block_bytes)
    # a whole number of aligned units stays O_DIRECT-able; a shorter tail is its own block
    if length > align_bytes:
        return length - length % align_bytes
    return length


def use_direct(op: RingOp, offset_bytes: int, addr: int, length: int, align_bytes: int) -> bool:
    """O_DIRECT only when offset, address and length are aligned (cext/so_aio.c
    ``choose_fd``); the rest goes through the page cache."""
    return (op.fd_direct >= 0 and offset_bytes % align_bytes == 0
            and addr % align_bytes == 0 and length % align_bytes == 0)


def transfer(op: RingOp, offset_bytes: int, addr: int, length: int,
             align_bytes: int) -> tuple[int, int, bool]:
    """Move one block; (bytes done, errno or 0, end of file). Retries short transfers, so
    only a transfer of 0 bytes means the file ended."""
    done = 0
    while done < length:
        here, at = addr + done, offset_bytes + done
        fd = op.fd_buffered
        # O_DIRECT refuses (EINVAL) an unaligned offset, address or length: those go buffered
        if use_direct(op, at, here, length - done, align_bytes):
            fd = op.fd_direct
        view = (ctypes.c_char * (length - done)).from_address(here)
        try:
            n = os.pwritev(fd, [view], at) if op.is_write else os.preadv(fd, [view], at)
        except InterruptedError:
            continue
        except OSError as exc:
            return done, exc.errno or errno.EIO, False
        if n == 0:
            return done, 0, True
        done += n
    return done, 0, False


@dataclass(slots=True)
class _Request:
    op: RingOp
    issued: int = 0
    blocks: int = 0
    done_bytes: int = 0
    errno: int = 0
    end_of_file: bool = False
    error_offset: int = -1

    def finished(self) -> bool:
        return self.blocks == 0 and (self.failed() or self.issued == self.op.nbytes)

    def failed(self) -> bool:
        return self.errno != 0 or self.end_of_file


@dataclass(frozen=True, slots=True)
class _BlockDone:
    tag: int
    offset_bytes: int
    done_bytes: int
    errno: int
    end_of_file: bool


_WAKE = object()


class ThreadRing:
    """storage/ring.py ``Ring`` on a thread pool."""

    backend = "threads"

    def __init__(self, *, queue_depth: int, max_requests: int, block_bytes: int,
                 align_bytes: int) -> None:
        self.queue_depth = queue_depth
        self.max_requests = max_requests
        self.block_bytes = block_bytes
        self.align_bytes = align_bytes
        # in submission order: the round robin's
        self._requests: dict[int, _Request] = {}
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._in_flight = 0
        self._last_tag = -1
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=min(queue_depth, MAX_THREADS), thread_name_prefix="superoffload-aio-io")

    def submit(self, op: RingOp) -> None:
        if len(self._requests) >= self.max_requests:
            raise RuntimeError("threads submit: every request slot of the ring is taken")
        self._requests[op.tag] = _Request(op)

    def run(self, timeout_ms: int = -1) -> list[RingCompletion]:
        woken = False
        while True:
            self._fill()
            done = self._emit()
            if done or woken or self._in_flight == 0:
                return done
            try:
                event = self._events.get(timeout=None if timeout_ms < 0 else timeout_ms / 1e3)
            except queue.Empty:
                return []
            if event is _WAKE:
                woken = True
            elif isinstance(event, _BlockDone):
                self._block_done(event)

    def wake(self) -> None:
        self._events.put(_WAKE)

    def close(self) -> None:
        if self._pool is not None:
            # the blocks in flight still write into buffers
            self._pool.shutdown(wait=True)
            self._pool = None

    def _fill(self) -> None:
        # one block per unfinished request in turn (cext/so_aio.c ``fill``): a small read
        # is not queued behind a large write-back
        while self._in_flight < min(self.queue_depth, MAX_THREADS):
            ready = [r for r in self._requests.values()
                     if not r.failed() and r.issued < r.op.nbytes]
            if not ready:
                return
            # the first after the request carved last (tags grow with submission order)
            req = next((r for r in ready if r.op.tag > self._last_tag), ready[0])
            self._last_tag = req.op.tag
            self._carve(req)

    def _carve(self, req: _Request) -> None:
        op = req.op
        offset = op.offset_bytes + req.issued
        length = block_length(offset, op.nbytes - req.issued, self.block_bytes,
                              self.align_bytes)
        addr = op.addr + req.issued
        req.issued += length
        req.blocks += 1
        self._in_flight += 1
        assert self._pool is not None
        future = self._pool.submit(transfer, op, offset, addr, length, self.align_bytes)

        def report(f: object, tag: int = op.tag, at: int = offset) -> None:
            try:
                done, code, eof = future.result()
            except BaseException as exc:
                # a bug in transfer: fail the block, never hang
                done, code, eof = 0, getattr(exc, "errno", None) or errno.EIO, False
            self._events.put(_BlockDone(tag, at, done, code, eof))

        future.add_done_callback(report)

    def _block_done(self, event: _BlockDone) -> None:
        self._in_flight -= 1
        req = self._requests[event.tag]
        req.blocks -= 1
        req.done_bytes += event.done_bytes
        at = event.offset_bytes + event.done_bytes
        # the failure nearest the start is the one reported (cext/so_aio.c ``fail``)
        if (event.errno or event.end_of_file) and (not req.failed() or at < req.error_offset):
            req.errno, req.end_of_file = event.errno, event.end_of_file
            req.error_offset = at

    def _emit(self) -> list[RingCompletion]:
        done = [r for r in self._requests.values() if r.finished()]
        for r in done:
            del self._requests[r.op.tag]
        return [RingCompletion(tag=r.op.tag, done_bytes=r.done_bytes, errno=r.errno,
                               end_of_file=r.end_of_file, error_offset=r.error_offset)
                for r in done]
