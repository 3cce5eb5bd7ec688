"""The storage tier of this machine, measured by the project's own I/O engine (DESIGN.md §7).

``measure_storage_tier(folder)`` writes and reads a scratch file in ``folder`` through
``superoffload.storage.measure_storage`` -- the engine the tier runs on (asynchronous,
several requests in flight, O_DIRECT where the file system allows it; docs/storage.md) --
at the block size and queue depth the engine uses by default, and returns the profile's
``storage_*`` fields with "measured" sources (plan/storage_presets.py's form). The capacity is
what the file system has free there. A machine without that engine built raises a
ValueError saying so; the presets' spec-sheet tiers need nothing.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from superoffload.config import OffloadConfig

SIZE_BYTES = 1 << 30
"""Bytes written and read once each: 1 GiB, past the drives' write caches."""
SIZE_BYTES_QUICK = 64 << 20
"""``quick=True`` (tests): 64 MiB, in the page cache where O_DIRECT is refused."""


def measure_storage_tier(folder: str | os.PathLike[str], *, quick: bool = False,
                         size_bytes: int | None = None) -> dict[str, Any]:
    """The ``HardwareProfile`` storage fields of ``folder`` (module docstring), with a
    ``sources`` tuple to merge (``storage_presets.with_tier``)."""
    try:
        from superoffload.storage import measure_storage
    except ImportError as exc:  # an install without the I/O engine
        raise ValueError(f"measuring the storage tier needs the project's I/O engine "
                         f"(superoffload.storage): {exc}") from None
    if not os.path.isdir(folder):
        raise ValueError(f"storage tier {str(folder)!r}: no such folder; name a folder on the "
                         "disk the tier will use")
    defaults = OffloadConfig()
    block, depth = defaults.storage_block_bytes, defaults.storage_queue_depth
    size = size_bytes or (SIZE_BYTES_QUICK if quick else SIZE_BYTES)
    # the engine's own block size and queue depth, so the rates are the ones it will get
    m = measure_storage(folder, size_bytes=size, block_bytes=block, queue_depth=depth)
    # the tier's capacity is what the folder's disk has free now
    free = float(shutil.disk_usage(folder).free)
    # O_DIRECT bypasses the page cache; a buffered measurement may read the cache's speed
    mode = "O_DIRECT" if m.direct else "buffered"
    how = (f"measured: superoffload.storage.measure_storage on {str(folder)!r}, {size >> 20} MiB "
           f"in {block >> 10} KiB requests, {m.queue_depth} in flight, {mode}, {m.backend}")
    return {
        "storage_read_gbps": float(m.read_gbps),
        "storage_write_gbps": float(m.write_gbps),
        "storage_bytes": free,
        "storage_queue_depth": int(m.queue_depth),
        "storage_name": f"{folder} ({m.backend}, {mode})",
        "sources": (
            ("storage_read_gbps", how),
            ("storage_write_gbps", how),
            ("storage_bytes", f"measured: free space of {str(folder)!r} (shutil.disk_usage)"),
            ("storage_queue_depth", how),
        ),
    }
