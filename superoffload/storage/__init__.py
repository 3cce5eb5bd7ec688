"""The storage tier's I/O: files streamed through pinned host buffers (DESIGN.md §7;
docs/storage.md, "I/O engine").

Public API:
    aligned_empty(nbytes, *, pin, alignment=4096) -> torch.Tensor      # storage/aligned.py
    AioEngine(*, queue_depth=32, block_bytes=1 << 20, thread_count=1, direct="auto",
              backend="auto")                                          # storage/aio.py
        .backend; .open(path, size_bytes, *, create=True) -> TierFile
        .read(file, offset_bytes, tensor) / .write(...) -> IoRequest   # .wait(), .done()
        .fsync(file); .close_file(file); .counters() -> IoCounters; .close()
    StorageError (an OSError: file, offset, errno), StorageWarning      # storage/io_errors.py
    measure_storage(folder, *, size_bytes, block_bytes, queue_depth)
        -> StorageMeasurement                                          # storage/folder_speed.py

Importing this package loads torch and nothing else: the compiled engine loads, and the
submitter threads start, when an ``AioEngine`` is made.
"""

from superoffload.storage.aio import AioEngine, IoCounters
from superoffload.storage.aligned import aligned_empty
from superoffload.storage.files import TierFile
from superoffload.storage.folder_speed import StorageMeasurement, measure_storage
from superoffload.storage.io_errors import StorageError, StorageWarning
from superoffload.storage.request import IoRequest

__all__ = [
    "AioEngine",
    "IoCounters",
    "IoRequest",
    "StorageError",
    "StorageMeasurement",
    "StorageWarning",
    "TierFile",
    "aligned_empty",
    "measure_storage",
]
