"""The storage lane of a simulated iteration: reads and write-backs of the optimizer state of
the buckets on the storage tier, and of weights kept there (DESIGN.md §7; docs/storage.md).

What the engine does (runtime/tier.py, runtime/tier_steps.py), as the simulator times it:
  * a pool of ``Resolved.storage_buffer_count`` slots, each one tier bucket's working set;
    tier buckets take slots in the order backward finishes them (bucket ids), the read of a
    bucket's state (master | m | v) issued as soon as a slot is free -- from the start of the
    iteration's forward for the first ones (read-ahead);
  * the bucket's gradient lands in its slot: its D2H waits for the slot (the D2H lane stays in
    gradient-ready order, so a bucket waiting for a slot holds the ones behind it);
  * the CPU step waits for the D2H and the read (and, without speculation, for validation);
  * after the step the new state and the gradient are written back (speculation: the version
    not in force, so a rollback reads nothing back; without it the gradient is written at
    launch and the state read again, with the gradient, for the step after the verdict); the
    slot is free when the write has ended and the step's weights have left for the device;
  * weight-flow's homes in the file (``OffloadConfig.weight_homes``, plan/storage.py): the
    copy the step writes is part of the state written back, and each fetch reads the block's
    part of those homes first (forward and backward; plan/sim_walk.py).
One lane of the profile's read and write rates carries all of it (the drives are shared):
a job runs at ``bytes / rate`` in the first gap of the lane at or after its ready time, so
weight fetches (placed as the forward needs them) are never pushed back by state I/O placed
later -- the engine submits them ahead, on the critical path. The rates scale down linearly
below the queue depth the profile says they need (Little's law: fewer requests in flight,
less throughput), and the tier's DMA crosses the host memory bus like the link's: a tier
bucket's CPU step carries its read and write bytes on the bus (plan/cost.py, "host lane").
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

import numpy as np

from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory_host import HostSide
from superoffload.plan.resolved import Resolved
from superoffload.telemetry import events as ev


class StorageLane:
    """Busy intervals of the storage lane; ``place`` puts a job in the first gap that fits."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def place(self, ready: float, dur: float) -> tuple[float, float]:
        """(start, end) of a job of ``dur`` seconds ready at ``ready``."""
        if not self.ends or ready >= self.ends[-1]:
            self.starts.append(ready)
            self.ends.append(ready + dur)
            return ready, ready + dur
        t = ready
        j = bisect.bisect_right(self.ends, ready)  # intervals from j end after `ready`
        while j < len(self.starts) and self.starts[j] < t + dur:
            t = max(t, self.ends[j])
            j += 1
        self.starts.insert(j, t)
        self.ends.insert(j, t + dur)
        return t, t + dur


@dataclass(frozen=True, slots=True)
class TierJobs:
    """Per host bucket of one (shape, plan): what the storage lane does for it (seconds)."""

    tier: np.ndarray
    """The bucket's state is on the tier."""
    read_s: np.ndarray
    write_s: np.ndarray
    filed: np.ndarray
    """The bucket's weight-flow home is in the file: the next fetch waits for its write."""
    replay_read_s: np.ndarray
    """A replay after clipping reads the state in force and the gradient back."""
    slots: int
    read_bytes: np.ndarray
    write_bytes: np.ndarray
    io_bus_bytes: np.ndarray
    """Bytes per element of the bucket the tier's DMA moves over the host bus."""

def rates_bps(prof: HardwareProfile, plan: Resolved) -> tuple[float, float]:
    """(read, write) bytes per second of the tier at the configured queue depth."""
    depth = min(1.0, plan.storage_queue_depth / max(prof.storage_queue_depth, 1))
    return prof.storage_read_gbps * 1e9 * depth, prof.storage_write_gbps * 1e9 * depth


def tier_jobs(side: HostSide, plan: Resolved, prof: HardwareProfile, nb: int
              ) -> TierJobs | None:
    """The jobs of the ``nb`` host buckets; None when none is on the tier."""
    tier = side.tier
    on = np.zeros(nb, dtype=bool)
    filed = np.zeros(nb, dtype=bool)
    rb, wb, replay = np.zeros(nb), np.zeros(nb), np.zeros(nb)
    if tier is not None:
        for r in tier.regions:
            if r.bucket < nb:
                on[r.bucket] = True
                if plan.speculate:
                    # speculated: read the state, write state + gradient
                    rb[r.bucket] = r.state_bytes
                else:
                    # not speculated: the gradient written at launch, state + gradient read for
                    # the step after the verdict, state written
                    rb[r.bucket] = r.state_bytes * 2 + r.grad_bytes
                wb[r.bucket] = r.state_bytes + r.grad_bytes
                replay[r.bucket] = r.state_bytes + r.grad_bytes
                filed[r.bucket] = r.home_offset is not None
    if not on.any():
        return None
    if not prof.has_storage:
        raise ValueError(f"profile {prof.name} has no storage tier and the plan puts state or "
                         "weights there: give the profile one (--storage, "
                         "plan.storage_presets)")
    read_bps, write_bps = rates_bps(prof, plan)
    numel = np.asarray([b.numel for b in plan.bucket_plan.host_buckets][:nb], dtype=float)
    per_elem = np.where(numel > 0, (rb + wb) / np.maximum(numel, 1.0), 0.0)
    slots = tier.slots if tier is not None else 1
    return TierJobs(on, rb / read_bps, wb / write_bps, filed, replay / read_bps, max(1, slots),
                    rb, wb, per_elem)


@dataclass
class LaneState:
    """What carries from one iteration to the next."""

    lane: StorageLane = field(default_factory=StorageLane)
    slot_free: list[float] = field(default_factory=list)
    """A heap of the times slots are (or will be) free."""


@dataclass(frozen=True, slots=True)
class Phase:
    """One iteration's bucket lanes with the tier: D2H, CPU, reads and writes."""

    ds: np.ndarray
    de: np.ndarray
    cs: np.ndarray
    ce: np.ndarray
    reads: list[tuple[float, float, int, int]]
    """(start, end, bucket, bytes)."""
    writes: list[tuple[float, float, int, int]]
    copy_end: np.ndarray
    """When each bucket's new weights are in their home: its write-back's end when the home
    is in the file, its CPU end otherwise."""


def bucket_phase(jobs: TierJobs, state: LaneState, *, grad_at: np.ndarray,
                 d2h_dur: np.ndarray, cpu_dur: np.ndarray, h2d_dur: np.ndarray,
                 deadline: bool, gate: float, read_from: float, d2h_free: float,
                 cpu_free: float) -> Phase:
    """The D2H, CPU and storage lanes of one iteration for ``nb`` host buckets (module
    docstring). ``grad_at``: when each bucket's gradients may leave; ``gate``: the CPU's
    earliest start (validation's end without speculation, else 0); ``read_from``: the
    iteration's forward start. An event loop: reads are issued while slots are free, the D2H
    lane advances in gradient-ready order while its next bucket has a slot, then the CPU lane
    takes its next bucket by the step order -- every input of which is known by then, since
    a slot frees only after a step not yet taken."""
    nb = len(grad_at)
    while len(state.slot_free) < jobs.slots:
        heapq.heappush(state.slot_free, 0.0)
    tier_ids = [b for b in range(nb) if jobs.tier[b]]
    slot_at = np.full(nb, -1.0)
    read_end = np.zeros(nb)
    ds, de = np.zeros(nb), np.zeros(nb)
    cs, ce = np.zeros(nb), np.zeros(nb)
    copy_end = np.zeros(nb)
    reads: list[tuple[float, float, int, int]] = []
    writes: list[tuple[float, float, int, int]] = []
    order = sorted(range(nb), key=lambda b: (grad_at[b], b))  # the D2H lane's order
    next_read = next_d2h = 0
    ready_heap: list[tuple[float, int]] = []  # (input ready, bucket), not yet stepped
    stepped = 0
    while stepped < nb:
        while next_read < len(tier_ids) and state.slot_free:
            b = tier_ids[next_read]
            next_read += 1
            slot_at[b] = heapq.heappop(state.slot_free)
            s, e = state.lane.place(max(read_from, slot_at[b]), float(jobs.read_s[b]))
            read_end[b] = e
            reads.append((s, e, b, int(jobs.read_bytes[b])))
        while next_d2h < nb:
            b = order[next_d2h]
            if jobs.tier[b] and slot_at[b] < 0:
                break  # its gradient needs a slot: the D2H lane waits with it
            ds[b] = max(d2h_free, grad_at[b], slot_at[b])
            de[b] = d2h_free = ds[b] + d2h_dur[b]
            heapq.heappush(ready_heap, (max(de[b], read_end[b], gate), b))
            next_d2h += 1
        if not ready_heap:  # pragma: no cover - a slot is always freed by a step taken
            raise RuntimeError("storage lane: no bucket can step (no free slot)")
        b = _next_step(ready_heap, cpu_free, deadline)
        cs[b] = max(cpu_free, _ready_of(b, de, read_end, gate))
        ce[b] = cpu_free = cs[b] + cpu_dur[b]
        stepped += 1
        copy_end[b] = ce[b]
        if jobs.tier[b]:
            s, e = state.lane.place(ce[b], float(jobs.write_s[b]))
            writes.append((s, e, b, int(jobs.write_bytes[b])))
            if jobs.filed[b]:  # the new weights are part of the state written back
                copy_end[b] = e
            # the slot holds the step's weights until they left for the device
            heapq.heappush(state.slot_free, max(e, ce[b] + h2d_dur[b]))
    return Phase(ds, de, cs, ce, reads, writes, copy_end)


def _ready_of(b: int, de: np.ndarray, read_end: np.ndarray, gate: float) -> float:
    return max(float(de[b]), float(read_end[b]), gate)


def _next_step(heap: list[tuple[float, int]], cpu_free: float, deadline: bool) -> int:
    """Pop the bucket the CPU steps next: FIFO the first ready; earliest deadline first, of
    those ready when the lane is free (or, if none, when the first is), the highest id (the
    one the next forward needs first)."""
    if not deadline:
        return heapq.heappop(heap)[1]
    t = max(cpu_free, heap[0][0])
    ready = [entry for entry in heap if entry[0] <= t]
    pick = max(ready, key=lambda entry: entry[1])
    heap.remove(pick)
    heapq.heapify(heap)
    return pick[1]


def chunks(ph: Phase, it: int) -> list:
    """The storage lane's span chunks of one iteration (the simulator's chunk tuples)."""
    out: list = []
    for kind, jobs in ((ev.KIND_TIER_READ, ph.reads), (ev.KIND_TIER_WRITE, ph.writes)):
        if jobs:
            s, e, b, n = zip(*jobs)
            out.append((ev.LANE_STORAGE, kind, list(s), list(e), it, list(b), list(n)))
    return out
