"""Three tiers of memory for the optimizer state: which host buckets live in files, the pinned
buffer pool that carries them, the files' layout, and the host bytes the engine keeps
(DESIGN.md §7; docs/storage.md).

Pure data in, data out: the engine (runtime/tier.py) allocates exactly this, and the planner
(plan/memory.py) charges exactly this, so a prediction describes the memory that runs.

Legend: a *tier bucket*'s fp32 master and Adam moments live in files under
``OffloadConfig.storage_path``; a *resident* bucket keeps them in host memory as without a
tier. A *slot* is one pinned host buffer of the pool holding one tier bucket's working set
while it is stepped: its state (master | m | v, the file's layout byte for byte, so one read
fills it), its gradient buffer, and the low-precision weight copy the kernel writes when
parameters are cast on the host (paper §4.4). All offsets and sizes are multiples of
``ALIGN`` so the I/O can bypass the page cache (O_DIRECT).

Per tier bucket the file holds two *versions* of the state and a gradient region:

* a speculative step (paper §4.3) writes the version not in force; validation commits it by
  switching versions, and a rollback is the switch not made -- bit-exact, nothing read back,
  whatever ``OffloadConfig.rollback`` says for the resident buckets;
* a crash at any moment leaves the version in force whole (the other may be torn);
* the gradient region keeps a gradient that must outlive its slot: a bucket stepped after
  validation, or a speculated one that clipping may replay.

So files take (2 x state + gradient) bytes per element of a tier bucket: 28 B with fp32
moments and gradients, 20 B with bf16 moments and gradients cast on the host.

Weight-flow's *homes* (the weights blocks stream from, runtime/weightflow.py) of a tier bucket
stay in host memory or, with ``Homes`` (``OffloadConfig.weight_homes``), live in the file as
part of its state: the state becomes master | m | v | lp, so a speculative step's new weights
go to the version not in force with the rest, a rollback keeps the old ones and a crash never
tears the weights in force (an fp32 model's home is its master, already there). A fetch reads
a block's part of each home into ``Homes.buffers`` pinned staging buffers, each one bucket's
home at most (docs/storage.md, "Weights on the tier").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from superoffload.plan.buckets import Bucket

ALIGN = 4096
"""Alignment of every file offset, size and buffer address (O_DIRECT's logical block)."""


def keeps_copies(rollback: str, speculation: str) -> bool:
    """Whether speculative steps may keep pre-step copies of p, m and v in host memory:
    ``rollback="snapshot"`` always, ``"auto"`` at worst -- its rescue keeps whole parameters
    while the moments hold one or two gradients (the first steps, runtime/auto_rollback.py)
    -- so a host budget holds them; never under ``speculation="off"``."""
    return speculation != "off" and rollback in ("snapshot", "auto")


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    # ceil division by floor-dividing the negation: exact on integers of any size
    return -(-int(nbytes) // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class ElementBytes:
    """Bytes per element of an offloaded bucket, by buffer (the engine's dtypes)."""

    moment: int
    """One Adam moment: 4 (fp32) or 2 (``optimizer_state_dtype="bf16"``)."""
    grad: int
    """The host gradient buffer: 4 (fp32), or 2 when gradients are cast on the host."""
    lp: int
    """The low-precision weight copy the kernel writes (parameters cast on the host), else 0."""
    snapshot: bool = False
    """Resident buckets keep pre-step p, m, v (``keeps_copies``: snapshot rollback, or the
    "auto" rollback's rescue at its worst)."""
    home: int = 0
    """Weight-flow: bytes per element of a tier bucket's weights kept in host memory in the
    model's dtype (the home the blocks stream from, runtime/weightflow.py); 0 without
    weight-flow. A resident bucket's home is its low-precision copy or its master, counted
    above."""

    @property
    def state(self) -> int:
        """fp32 master + both moments: what the files hold per element and version."""
        return 4 + 2 * self.moment

    @property
    def state_with_home(self) -> int:
        """The state of a bucket whose weight-flow home is in the file: the low-precision
        copy after the moments (an fp32 model's home is the master itself)."""
        return self.state + self.lp

    @property
    def resident(self) -> int:
        """A resident bucket in host memory: state, gradient buffer, copy, snapshot."""
        return self.state + self.grad + self.lp + (self.state if self.snapshot else 0)


Place = Literal["host", "storage", "auto"]


@dataclass(frozen=True, slots=True)
class Homes:
    """Weight-flow's homes of the tier buckets (``OffloadConfig.weight_homes``)."""

    place: Place
    """"host": in host memory; "storage": in the file; "auto": in the file only when host
    memory (the budget) cannot hold them, the buckets backward finishes first moving first."""
    stream: int
    """Bytes per element a fetch copies (the model dtype's; an fp32 model's master: 4)."""
    buffers: int
    """Pinned staging buffers a fetch reads homes into (``prefetch_depth + 1``)."""


@dataclass(frozen=True, slots=True)
class Region:
    """One tier bucket's place in its file (bytes)."""

    bucket: int
    numel: int
    state_offsets: tuple[int, int]
    """Offset of version 0 and version 1 of the state (master | m | v)."""
    state_bytes: int
    """Aligned size of one version."""
    grad_offset: int
    grad_bytes: int
    """Aligned size of the gradient region."""
    home_offset: int | None = None
    """Where the weights a fetch reads begin inside each version of the state (bytes: the
    copy after v, or 0 for an fp32 master), or None when its home is not in the file."""


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Offsets inside one pool slot (bytes); sized for the largest tier bucket."""

    grad_offset: int
    lp_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TierPlan:
    """Where each offloaded bucket's state lives and what the host keeps (module docstring)."""

    tier: tuple[int, ...]
    """Tier bucket ids, in the order backward finishes them (the read-ahead order)."""
    resident: tuple[int, ...]
    """Offloaded buckets whose state stays in host memory."""
    slots: int
    """Pool buffers (0 without tier buckets)."""
    slot: SlotLayout
    regions: tuple[Region, ...]
    """Per tier bucket, in ``tier`` order."""
    file_bytes: int
    """Size of the tier's file (allocated in full when the engine starts)."""
    host_parts: dict[str, int]
    """What the engine keeps in host memory, by part (bytes)."""
    element: ElementBytes
    stage: tuple[int, int] = (0, 0)
    """Weight-flow homes in the file: (staging buffers, bytes of one), else (0, 0)."""

    @property
    def file_homes(self) -> tuple[int, ...]:
        """Tier buckets whose weight-flow home lives in the file."""
        return tuple(r.bucket for r in self.regions if r.home_offset is not None)

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())

    @property
    def tier_numel(self) -> int:
        return sum(r.numel for r in self.regions)

    def region_of(self, bucket: int) -> Region:
        for r in self.regions:
            if r.bucket == bucket:
                return r
        raise KeyError(f"bucket {bucket} is not on the storage tier")

    def read_bytes(self) -> int:
        """Bytes one optimizer step reads from the tier: every tier bucket's state once."""
        return sum(r.state_bytes for r in self.regions)

    def home_bytes(self, stream: int) -> int:
        """Bytes one fetch of every block reads from the file (``stream`` B per element of
        each home there); a forward reads them once, a backward again."""
        return sum(r.numel * stream for r in self.regions if r.home_offset is not None)

    def write_bytes(self, *, spill: bool) -> int:
        """Bytes one step writes: each state once, plus the gradients when they spill
        (clipping may replay, or a bucket is stepped after validation)."""
        # a gradient stepped from its slot right away never reaches the file
        return sum(r.state_bytes + (r.grad_bytes if spill else 0) for r in self.regions)


class TierError(ValueError):
    """The budget or the tier cannot hold the model; the message names the field and the fix."""


def plan_tier(host_buckets: Sequence[Bucket], element: ElementBytes, *, storage: bool,
              budget_bytes: int | None, buffer_count: int,
              homes: Homes | None = None) -> TierPlan:
    """Place the offloaded buckets ``host_buckets`` (bucket order: the order backward finishes
    them) in host memory or in the storage tier.

    Without ``storage`` every bucket is resident; with it and no budget every bucket is on the
    tier. With a budget the pool is reserved first and the buckets backward finishes last
    stay resident while they fit. A budget that cannot hold what must stay in memory is a
    ``TierError`` naming what it needs. ``homes``: weight-flow's homes of the tier buckets
    (None: in host memory, ``element.home`` B per element); in the file they cost the staging
    buffers instead (module docstring)."""
    ordered = sorted(host_buckets, key=lambda b: b.id)
    if homes is not None:
        check_homes(homes.place, storage=storage)
    # weight-flow on a tier: homes may go to the file ("" otherwise)
    place = homes.place if storage and homes is not None else ""
    # "auto" tries memory first; an fp32 model's home (0 B here) is its master, in the file
    if place in ("", "host") or (place == "auto" and element.home):
        try:
            plan = _homes_in_memory(ordered, element, storage=storage,
                                    budget_bytes=budget_bytes, buffer_count=buffer_count)
        except TierError:
            # only "auto" may fall back to homes in the file
            if place in ("", "host"):
                raise
        else:
            if place and plan.tier and not element.home:  # "host" for an fp32 model
                raise TierError("OffloadConfig.weight_homes='host' with weight-flow of an fp32 "
                                "model on the storage tier: its weights are the fp32 masters, "
                                "which live in the tier's files; use weight_homes='storage' or "
                                "'auto'")
            return plan
    assert homes is not None
    return _homes_in_file(ordered, element, budget_bytes, buffer_count, homes)


def check_homes(place: str, *, storage: bool) -> None:
    """Homes in the file need a file (``OffloadConfig.storage_path``)."""
    if place == "storage" and not storage:
        raise TierError("OffloadConfig.weight_homes='storage' keeps weight-flow's weights in "
                        "the storage tier's files: set OffloadConfig.storage_path, or use "
                        "weight_homes='host' or 'auto'")


_FILE_HINT = " (or keep the homes in the files: OffloadConfig.weight_homes='auto')"


def _homes_in_memory(ordered: Sequence[Bucket], element: ElementBytes, *, storage: bool,
                     budget_bytes: int | None, buffer_count: int) -> TierPlan:
    """The rule with every tier bucket's weight-flow home (if any) in host memory."""
    # a bucket moved to the tier keeps its home in memory: it costs (resident - home) less
    resident_cost = {b.id: b.numel * (element.resident - element.home) for b in ordered}
    home = sum(b.numel for b in ordered) * element.home
    if not storage:
        need = sum(b.numel for b in ordered) * element.resident
        if budget_bytes is not None and need > budget_bytes:
            raise TierError(
                f"OffloadConfig.host_memory_budget_bytes={budget_bytes:,} is below the "
                f"{need:,} bytes the offloaded optimizer state needs in host memory; set "
                "OffloadConfig.storage_path to keep part of it in files (docs/storage.md), or "
                "raise the budget")
        return _plan((), tuple(b.id for b in ordered), ordered, element, 0)
    slot_bytes = _slot_layout(ordered, element, filed=False).nbytes if ordered else 0
    pool = min(buffer_count, len(ordered)) * slot_bytes
    resident: list[int] = []
    if budget_bytes is not None:
        # the pool and the homes are needed whatever stays resident: reserved first
        left = budget_bytes - pool - home
        if left < 0:
            raise TierError(
                f"OffloadConfig.host_memory_budget_bytes={budget_bytes:,} cannot hold the "
                f"storage tier's pinned buffers: {min(buffer_count, len(ordered))} x "
                f"{slot_bytes:,} bytes (OffloadConfig.storage_buffer_count x the largest "
                f"bucket's working set){' plus the weight-flow homes' if home else ''}; lower "
                "storage_buffer_count or bucket_bytes, or raise the budget"
                f"{_FILE_HINT if home else ''}")
        # the last ones backward finishes stay while they fit: their steps end the iteration,
        # where a late read would stall the next forward; the first ones' reads overlap the
        # forward and the start of backward
        for b in reversed(ordered):
            if resident_cost[b.id] > left:
                break
            resident.append(b.id)
            left -= resident_cost[b.id]
    tier = tuple(b.id for b in ordered if b.id not in resident)
    if not tier:  # everything fits: no pool, no file
        return _plan((), tuple(b.id for b in ordered), ordered, element, 0)
    return _plan(tier, tuple(sorted(resident)), ordered, element, buffer_count)


def _homes_in_file(ordered: Sequence[Bucket], element: ElementBytes, budget_bytes: int | None,
                   buffer_count: int, homes: Homes) -> TierPlan:
    """The rule with weight-flow's homes in the file: every tier bucket's ("storage", or an
    fp32 model's), or ("auto", the homes not fitting in memory) the fewest, in the order
    backward finishes the buckets -- their blocks are the last, fetched first in backward."""
    # an fp32 model's homes are its masters: in the file whatever weight_homes says
    every = homes.place == "storage" or not element.home
    slot_bytes = _slot_layout(ordered, element, filed=True).nbytes
    count = min(buffer_count, len(ordered))
    stage = _stage_bytes(ordered, homes.stream)
    resident: list[int] = []
    filed = [b.id for b in ordered]
    if budget_bytes is not None:
        left = budget_bytes - count * slot_bytes - homes.buffers * stage
        if not every:
            # "auto": start from every home in memory, move the fewest
            left -= sum(b.numel for b in ordered) * element.home
            filed = []
            # the first ones backward finishes (the last blocks, fetched first) move first
            for b in ordered:
                if left >= 0:
                    break
                filed.append(b.id)
                left += b.numel * element.home
        if left < 0:
            raise TierError(
                f"OffloadConfig.host_memory_budget_bytes={budget_bytes:,} cannot hold the "
                f"storage tier's pinned buffers: {count} x {slot_bytes:,} bytes "
                "(OffloadConfig.storage_buffer_count x the largest bucket's working set) "
                f"plus weight-flow's staging buffers: {homes.buffers} x {stage:,} bytes "
                "(prefetch_depth + 1 x the largest bucket's weights); lower "
                "storage_buffer_count, bucket_bytes or prefetch_depth, or raise the budget")
        if every:
            # as in memory: the last ones backward finishes stay while they fit
            for b in reversed(ordered):
                if b.numel * element.resident > left:
                    break
                resident.append(b.id)
                left -= b.numel * element.resident
    tier = tuple(b.id for b in ordered if b.id not in resident)
    if not tier:
        return _plan((), tuple(b.id for b in ordered), ordered, element, 0)
    return _plan(tier, tuple(sorted(resident)), ordered, element, buffer_count,
                 filed=tuple(b for b in filed if b in tier), homes=homes)


def _stage_bytes(buckets: Sequence[Bucket], stream: int) -> int:
    """One staging buffer: the largest bucket's home, plus the ``ALIGN`` a read of part of it
    may take at either end to start and end on a block boundary (``aligned_span``)."""
    return aligned(max((b.numel for b in buckets), default=0) * stream) + ALIGN


def aligned_span(offset: int, nbytes: int) -> tuple[int, int, int]:
    """The aligned read covering bytes [offset, offset + nbytes) of a file: (start, length,
    skip), ``skip`` the bytes from ``start`` to ``offset``; ``length`` <= aligned(nbytes) +
    ALIGN (what ``_stage_bytes`` allows)."""
    # O_DIRECT reads whole blocks: round the start down and the end up, and skip the head
    start = offset // ALIGN * ALIGN
    return start, aligned(offset + nbytes) - start, offset - start


def _slot_layout(buckets: Sequence[Bucket], element: ElementBytes, *, filed: bool) -> SlotLayout:
    # one slot fits any tier bucket: sized by the largest
    numel = max((b.numel for b in buckets), default=0)
    grad_offset = aligned(numel * (element.state_with_home if filed else element.state))
    lp_offset = grad_offset + aligned(numel * element.grad)
    # under weight-flow the kernel writes the copy into the bucket's home, not the slot
    lp = 0 if element.home else element.lp
    return SlotLayout(grad_offset, lp_offset, lp_offset + aligned(numel * lp))


def _plan(tier: tuple[int, ...], resident: tuple[int, ...], ordered: Sequence[Bucket],
          element: ElementBytes, buffer_count: int, *, filed: tuple[int, ...] = (),
          homes: Homes | None = None) -> TierPlan:
    by_id = {b.id: b for b in ordered}
    tier_buckets = [by_id[i] for i in tier]
    slot = _slot_layout(tier_buckets, element, filed=bool(filed))
    slots = min(buffer_count, len(tier))
    regions, offset = [], 0
    for b in tier_buckets:
        home = b.id in filed
        state = aligned(b.numel * (element.state_with_home if home else element.state))
        grad = aligned(b.numel * element.grad)
        home_offset = None
        if home:
            # the copy follows v; an fp32 model's home is its master, at the start
            home_offset = b.numel * element.state if element.lp else 0
        regions.append(Region(b.id, b.numel, (offset, offset + state), state,
                              offset + 2 * state, grad, home_offset))
        offset += 2 * state + grad
    stage = (0, 0)
    if filed and homes is not None:
        # homes in the file are read through staging buffers (Homes.buffers)
        stage = (homes.buffers, _stage_bytes([by_id[i] for i in filed], homes.stream))
    resident_numel = sum(by_id[i].numel for i in resident)
    parts = {
        "resident_state": resident_numel * element.state,
        "grad_buffers": resident_numel * element.grad,
        "lp_copies": resident_numel * element.lp,
        # tier buckets roll back by switching versions: only resident ones keep a snapshot
        "rollback_snapshot": resident_numel * element.state if element.snapshot else 0,
        "storage_pool": slots * slot.nbytes,
        # a resident bucket's home is its copy or master, counted above: only tier ones here
        "weight_flow_homes": sum(b.numel for b in tier_buckets if b.id not in filed)
        * element.home,
        "weight_stage_buffers": stage[0] * stage[1],
    }
    return TierPlan(tier, resident, slots, slot, tuple(regions), offset, parts, element, stage)
