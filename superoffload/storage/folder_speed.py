"""How fast a folder reads and writes through this engine: the storage tier of the
planner's machine profile (DESIGN.md §7; docs/storage.md, "I/O engine").

``measure_storage`` writes then reads a scratch file of ``size_bytes`` in the folder with
the engine's own settings (O_DIRECT where the file system takes it), and removes it.
``timed_pass`` is the one measured pass, shared with benchmarks/bench_storage.py so the
benchmark and the profile time the same thing.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from superoffload.storage.aio import AioEngine
from superoffload.storage.aligned import aligned_empty
from superoffload.storage.files import TierFile

REQUEST_BYTES = 64 << 20
"""Bytes per request of a pass: the buffer that is read into or written from, reused."""


@dataclass(frozen=True, slots=True)
class StorageMeasurement:
    read_gbps: float
    write_gbps: float
    queue_depth: int
    block_bytes: int
    direct: bool
    """Whether the passes bypassed the page cache (O_DIRECT)."""
    backend: str


def timed_pass(engine: AioEngine, file: TierFile, buffer: torch.Tensor, *,
               write: bool) -> float:
    """Seconds to move the whole file once, sequentially, in requests of the buffer's size
    with two requests in flight (so the ring never runs dry between them). Writes are not
    fsynced: like fio's default, the time is until the device took the data."""
    size, step = file.size_bytes, buffer.numel()
    io = engine.write if write else engine.read
    t0 = time.perf_counter()
    pending = []
    for offset in range(0, size, step):
        pending.append(io(file, offset, buffer[:min(step, size - offset)]))
        if len(pending) > 1:
            pending.pop(0).wait()
    for request in pending:
        request.wait()
    return time.perf_counter() - t0


def measure_storage(folder: str | os.PathLike[str], *, size_bytes: int, block_bytes: int,
                    queue_depth: int) -> StorageMeasurement:
    """Read and write GB/s (1e9 bytes per second) of ``folder`` through an ``AioEngine``
    with these settings, one pass each over a scratch file of ``size_bytes``."""
    path = Path(folder) / f".superoffload-measure-{uuid.uuid4().hex}.bin"
    with AioEngine(queue_depth=queue_depth, block_bytes=block_bytes) as engine:
        file = engine.open(path, size_bytes)
        try:
            buffer = aligned_empty(min(size_bytes, REQUEST_BYTES), pin=False)
            # incompressible, in case the device compresses
            buffer.random_(0, 256)
            write_s = timed_pass(engine, file, buffer, write=True)
            # a buffered read right after the write hits the cache
            if not file.direct:
                engine.fsync(file)
                os.posix_fadvise(file.fd_buffered, 0, 0, os.POSIX_FADV_DONTNEED)
            read_s = timed_pass(engine, file, buffer, write=False)
            direct = file.direct
        finally:
            path.unlink(missing_ok=True)
        return StorageMeasurement(read_gbps=size_bytes / read_s / 1e9,
                                  write_gbps=size_bytes / write_s / 1e9,
                                  queue_depth=queue_depth, block_bytes=block_bytes,
                                  direct=direct, backend=engine.backend)
