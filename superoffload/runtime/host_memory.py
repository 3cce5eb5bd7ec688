"""Host memory that is freed goes back to the operating system while a budget is in force
(``OffloadConfig.host_memory_budget_bytes``, docs/storage.md, "Sizing").

glibc serves an allocation above its mmap threshold with its own mapping, returned to the
system when freed; below it, from a heap whose freed space it keeps. The threshold starts at
128 KiB but *grows* to the size of every mapped block freed (up to 32 MiB), so after the
first step's gradients and temporaries are freed, later ones of a few MiB come from the heap
and stay resident when freed: a run's resident memory drifts above what the engine keeps.
With a budget the engine fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops
its growth), once per process, so what it frees leaves. Elsewhere than glibc: nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
THRESHOLD_BYTES = 256 << 10
"""Above this an allocation gets its own mapping: a model's tensors, buffers, temporaries."""

_done: list[bool] = []


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at ``THRESHOLD_BYTES`` (once); False where there is no
    glibc ``mallopt`` (another C library: nothing is changed)."""
    if _done:
        return _done[0]
    ok = False
    name = ctypes.util.find_library("c")
    if name is not None:
        try:
            libc = ctypes.CDLL(name)
            ok = bool(getattr(libc, "mallopt", None)) and \
                libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
        except OSError:
            ok = False
    _done.append(ok)
    return ok
