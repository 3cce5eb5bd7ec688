"""Weight-flow's reads of the homes that live in the storage tier's file (docs/storage.md,
"Weights on the tier"; the layout: plan/storage.py).

A block's weights held by a tier bucket whose home is in the file are part of that bucket's
state, in both versions. A fetch of the block reads, from the version in force, the bytes of
each such bucket that hold the block's parameters (one *span* per bucket) into a pinned
staging buffer of the tier (``StateTier.stage``), extended to 4 KiB boundaries so the read
bypasses the page cache (``plan.storage.aligned_span``), then copies the parameters' bytes to
the block's device buffer (the H2D stream on CUDA).

``spans`` runs on the training thread when the fetch is submitted: which bytes, and the write
whose version is in force (``StateTier.forced``: decided by ``step()``, before the next
forward submits any fetch). ``copy_spans`` runs on the fetch lane: each span's read starts
while the one before is copied, and a staging buffer is reused only once the copy out of it
has read it (``DeviceOps.host_wait``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.plan.storage import aligned_span
from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.tier import StateTier
from superoffload.telemetry.events import KIND_TIER_READ, LANE_STORAGE
from superoffload.telemetry.recorder import Recorder


@dataclass(frozen=True, slots=True)
class HomeSpan:
    """The bytes of one tier bucket's home that a block's fetch reads."""

    bucket: int
    offset: int
    """Bytes from the start of a version of the bucket's state."""
    nbytes: int
    forced: Future[Any] | None
    """The write whose version the read waits for (``StateTier.version_in_force``)."""
    parts: tuple[tuple[int, torch.Tensor], ...]
    """(bytes from the span's start, the device view of a parameter) per parameter."""


def spans(tier: StateTier, wanted: Sequence[tuple[int, int, torch.Tensor]]
          ) -> tuple[HomeSpan, ...]:
    """The spans holding ``wanted``: (bucket, position in it, device view) of parameters whose
    home is in the file. One span per bucket, from its first wanted byte to its last (a block
    owns consecutive parameters of a bucket, so little else is read)."""
    by_bucket: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for b, pos, view in wanted:
        book = tier.books[b]
        home_offset = book.region.home_offset
        assert home_offset is not None, f"bucket {b}'s home is not in the file"
        by_bucket.setdefault(b, []).append(
            (home_offset + book.starts[pos] * view.element_size(), view))
    out = []
    for b, parts in sorted(by_bucket.items()):
        first = min(at for at, _ in parts)
        end = max(at + v.numel() * v.element_size() for at, v in parts)
        out.append(HomeSpan(b, first, end - first, tier.forced(b),
                            tuple((at - first, v) for at, v in parts)))
    return tuple(out)


def copy_spans(tier: StateTier, todo: Sequence[HomeSpan], device_ops: DeviceOps,
               recorder: Recorder, *, iteration: int) -> Any:
    """Read every span of ``todo`` and copy its parameters to their device views; returns the
    last copy's token (``DeviceOps.wait`` orders the compute after it)."""
    free = list(range(len(tier.stage)))
    # (buffer, its copy's token)
    copying: deque[tuple[int, Any]] = deque()
    reading: deque[tuple[HomeSpan, int, Any, int, float, int]] = deque()
    waiting = deque(todo)
    token = None

    def issue() -> None:
        span = waiting.popleft()
        # the oldest copy must have read its buffer before the buffer is reused
        if not free:
            k, done = copying.popleft()
            device_ops.host_wait(done)
            free.append(k)
        k = free.pop()
        region = tier.books[span.bucket].region
        version = tier.version_in_force(span.bucket, span.forced)
        start, length, skip = aligned_span(region.state_offsets[version] + span.offset,
                                           span.nbytes)
        t0 = recorder.now()
        reading.append((span, k, tier.io.read(tier.file, start, tier.stage[k][:length]), skip,
                        t0, length))
        tier.count_read(length)

    try:
        for _ in range(min(len(free), len(waiting))):
            issue()
        while reading:
            span, k, request, skip, t0, length = reading.popleft()
            request.wait()
            recorder.add(LANE_STORAGE, KIND_TIER_READ, t0, recorder.now(), iteration=iteration,
                         nbytes=length)  # bucket -1: a weight read, not a state read
            memory = tier.stage[k]
            src = [memory[skip + at:skip + at + v.numel() * v.element_size()]
                   .view(v.dtype).view(v.shape) for at, v in span.parts]
            token = device_ops.h2d(src, [v for _, v in span.parts])
            copying.append((k, token))
            if waiting:
                issue()
    except BaseException:
        # the kernel writes into them until they end
        for _, _, request, _, _, _ in reading:
            with contextlib.suppress(Exception):
                request.wait()
        raise
    finally:
        # the next fetch reuses every buffer
        for _, done in copying:
            device_ops.host_wait(done)
    return token
