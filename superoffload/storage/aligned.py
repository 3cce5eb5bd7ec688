"""Host buffers O_DIRECT can use: aligned, and pinned for CUDA copies when a GPU is there
(docs/storage.md, "I/O engine").

O_DIRECT transfers a block only when its memory address is aligned (storage/ring.py
``ALIGN_BYTES``); torch's CPU allocator aligns to 64 bytes. ``aligned_empty`` allocates
``alignment`` bytes more and returns the aligned view, which keeps the whole allocation
alive. A pinned buffer comes from torch's pinned-memory allocator (so CUDA copies from it
are asynchronous); that allocator rounds small sizes up to a power of two, which a pool of
equal buffers should size for.
"""

from __future__ import annotations

import torch


def aligned_empty(nbytes: int, *, pin: bool, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` whose data_ptr is a multiple of
    ``alignment``; pinned when ``pin`` and CUDA is available, plain CPU memory otherwise."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes={nbytes!r} must be an int >= 0")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
            or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment={alignment!r} must be a power of two")
    pinned = bool(pin) and torch.cuda.is_available()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pinned)
    shift = -raw.data_ptr() % alignment
    return raw[shift:shift + nbytes]
