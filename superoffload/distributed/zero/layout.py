"""Which slice of each bucket a data-parallel rank owns (ZeRO stage-1/2 partitioning).

Pure functions, no torch state (STYLE.md §2). A bucket's parameters are laid end to end in
one flat buffer of ``bucket_numel`` elements, padded to ``padded_numel`` = a multiple of the
world size, and rank r owns the contiguous range ``[r * shard_numel, (r+1) * shard_numel)``
(ZeRO, Rajbhandari et al. 2020 §5: each rank keeps 1/N of the optimizer state; the
SuperOffload paper §4.6 offloads each rank's shard to its own CPU). That range cuts through
parameters, so a shard is a list of ``Segment``s: contiguous pieces of single parameters,
each a 1-D view the CPU Adam kernel can step on its own (the kernel takes any contiguous
fp32 1-D views).

``reduce_scatter`` of the padded flat gradient gives rank r exactly its range; the padding
elements are zeros that no segment covers, so they never reach the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous piece of one parameter inside one rank's shard."""

    pos: int
    """Position of the parameter in its bucket."""
    param_offset: int
    """First element of the piece within the flattened parameter."""
    shard_offset: int
    """First element of the piece within the rank's shard."""
    numel: int


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One rank's slice of one bucket."""

    rank: int
    world_size: int
    param_numels: tuple[int, ...]
    param_offsets: tuple[int, ...]
    """Start of each parameter in the (unpadded) flat bucket."""
    bucket_numel: int
    padded_numel: int
    shard_numel: int
    segments: tuple[Segment, ...]

    @property
    def shard_start(self) -> int:
        """First flat-bucket element this rank owns."""
        return self.rank * self.shard_numel

    @property
    def owned_numel(self) -> int:
        """Elements of real parameters in the shard (the rest is padding)."""
        return sum(s.numel for s in self.segments)


def shard_layout(param_numels: Sequence[int], *, rank: int, world_size: int) -> ShardLayout:
    """Partition a bucket of parameters with ``param_numels`` elements among ``world_size``
    ranks and return rank ``rank``'s slice."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: use a whole number >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: use a whole number in [0, world_size={world_size})")
    numels = tuple(int(n) for n in param_numels)
    if any(n < 0 for n in numels):
        raise ValueError(f"param_numels={numels}: element counts must be >= 0")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    shard = -(-total // world_size)  # ceil: every rank gets the same size (collectives need it)
    start, end = rank * shard, (rank + 1) * shard
    segments = []
    for pos, (off, n) in enumerate(zip(offsets, numels)):
        lo, hi = max(off, start), min(off + n, end)
        if lo < hi:
            segments.append(Segment(pos, lo - off, lo - start, hi - lo))
    return ShardLayout(rank, world_size, numels, tuple(offsets), total, shard * world_size,
                       shard, tuple(segments))


def all_layouts(param_numels: Sequence[int], world_size: int) -> list[ShardLayout]:
    """Every rank's slice of one bucket (checkpoint consolidation, tests)."""
    return [shard_layout(param_numels, rank=r, world_size=world_size) for r in range(world_size)]
