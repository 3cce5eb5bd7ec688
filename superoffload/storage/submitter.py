"""A submitter: one thread driving one ring (docs/storage.md, "I/O engine").

DeepSpeed's ``aio.thread_count`` is the number of these: each owns a ring with
``queue_depth`` blocks in flight, and a request is split among them (storage/aio.py). The
thread blocks in ``ring.run`` (inside C, without the GIL) until a request finished or
``put`` woke it; with nothing in the ring it blocks on a condition. No sleep-polling.

A failure of the thread itself (the ring broke, a bug) fails every part it held or had
queued with that exception, raised by their ``wait``; later ``put`` calls raise it too.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import threading
from collections import deque

from superoffload.storage.io_errors import StorageError
from superoffload.storage.request import Part
from superoffload.storage.ring import Ring


class Submitter:
    def __init__(self, ring: Ring, name: str, max_requests: int) -> None:
        self.ring = ring
        self.max_requests = max_requests
        self._tags = itertools.count()
        self._queue: deque[Part] = deque()
        self._in_ring: dict[int, Part] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def next_tag(self) -> int:
        # itertools.count is atomic under the GIL
        return next(self._tags)

    def put(self, part: Part) -> None:
        with self._cond:
            if self._failure is not None:
                raise StorageError(errno.EIO, f"the I/O thread {self._thread.name} failed "
                                   f"earlier: {self._failure!r}", path=part.request.file.path,
                                   offset_bytes=part.op.offset_bytes) from self._failure
            if self._closing:
                raise StorageError(errno.ESHUTDOWN, "the I/O engine is closed",
                                   path=part.request.file.path)
            self._queue.append(part)
            self._cond.notify()
            # under the lock: close() cannot free the ring between the check and the wake
            self.ring.wake()

    def close(self) -> None:
        """Finish every part put so far, stop the thread, free the ring."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            if self._thread.is_alive():
                self.ring.wake()
        self._thread.join()
        self.ring.close()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._queue or self._in_ring or self._closing):
                        self._cond.wait()
                    if self._closing and not self._queue and not self._in_ring:
                        return
                    new: list[Part] = []
                    while self._queue and len(self._in_ring) + len(new) < self.max_requests:
                        new.append(self._queue.popleft())
                for part in new:
                    self._in_ring[part.op.tag] = part
                    self.ring.submit(part.op)
                if not self._in_ring:
                    continue
                for done in self.ring.run(-1):
                    finished = self._in_ring.pop(done.tag)
                    finished.request.part_finished(finished.op, done)
        except BaseException as exc:
            # fail everything held, raised in the callers' threads
            # first: the kernel may still be writing into their buffers; the first failure
            # is the one to report
            with contextlib.suppress(BaseException):
                self.ring.close()
            with self._cond:
                self._failure = exc
                held = [*self._in_ring.values(), *self._queue]
                self._in_ring.clear()
                self._queue.clear()
            for part in held:
                part.request.part_finished(part.op, exc)

