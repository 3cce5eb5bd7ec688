"""The storage tier of one engine: offloaded buckets' optimizer state in a file, carried by a
bounded pool of pinned buffers (DESIGN.md §7; docs/storage.md; the layout: plan/storage.py).

A tier bucket's ``BucketBuffers`` hold no memory of their own. While the bucket is worked on
it is *bound* to a pool slot: its master, moments, gradient buffer and (host-cast) bf16 copy
are views into the slot, so every task of the step -- the D2H copy, the CPU kernel, the
publish -- runs on it unchanged. Per iteration (paper §4.2-4.3, on the tier):

1. read ahead: free slots take the next tier buckets in the order backward finishes them and
   read the version of their state in force (``begin``), while forward and backward run;
2. a bucket launches: it is bound (``bind``; backward waits here when every slot is busy,
   the tier's back-pressure, as ``grad_buckets_in_flight`` is the link's), its gradients land
   in the slot, the CPU steps it speculatively after both the copy and the read;
3. written back (``finish``): the new state goes to the *other* version, the gradient to its
   region when a replay may need it; the slot is free once the write ended and the publish
   has read the slot (the device copy landed). Weight-flow's home, when it lives in the file,
   is part of the state (plan/storage.py): its fetches read the version in force
   (``forced``, ``version_in_force``; runtime/home_reads.py);
4. validation (runtime/stv.py, ``settle``): COMMIT makes the written version the one in force
   (``commit``); a rollback is the switch not made (``discard``): bit-exact, nothing read
   back; a replay or a step after the verdict reads state and gradient back (``bind`` with
   ``grad=True``) and writes again.

Every read of a bucket is ordered after its last write. Everything runs on two lanes of
their own (``storage_read``, ``storage_write``), so a slow disk shows as storage spans and as
steps waiting for them on the timeline, never as a silent stall; a failed I/O names the
file, and the engine raises it at its next call (runtime/errors.py).

Past 400 lines: one concept, the pool's protocol -- which bucket holds which slot, which
version is in force, and the order every read and write of a bucket keeps; its tasks
(runtime/tier_tasks.py) and its uses outside a step (runtime/tier_access.py) live apart.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from superoffload.plan.storage import Region, TierPlan
from superoffload.runtime.engine_state import BucketBuffers, split_views
from superoffload.runtime.errors import EngineError, WatchdogTimeout
from superoffload.runtime.lanes import Lane
from superoffload.runtime.tier_tasks import Slot, TierRead, TierRelease, TierWrite
from superoffload.telemetry.events import (
    KIND_TIER_READ,
    KIND_TIER_WRITE,
    KIND_WAIT,
    LANE_COMPUTE,
    LANE_STORAGE,
)
from superoffload.telemetry.recorder import Recorder

Landed = Callable[[Any], None]
"""The host waits until a publish's device copy has read its source (``DeviceOps.host_wait``)."""


class StorageTierError(EngineError):
    """The storage tier cannot go on (a file deleted or truncated, a disk error); the message
    names the file and what to do. The last checkpoint is untouched (a separate copy)."""


@dataclass(slots=True)
class _Book:
    """What the tier knows of one tier bucket."""

    region: Region
    version: int = 0
    """The version of the state in force."""
    last_write: Future[Any] | None = None
    """The bucket's last write: every later read waits for it."""
    speculative: Future[Any] | None = None
    """The write of this iteration's speculative step, until validation decides on it."""
    grad_spilled: bool = False
    slot: Slot | None = None
    home: list[torch.Tensor] | None = None
    """Weight-flow: the bucket's weights in host memory (the home blocks stream from), or
    None (not weight-flow, or the home is in the file: ``region.home_offset``)."""
    forced: Future[Any] | None = None
    """The write whose version is in force once it ends, as the training thread decided it
    (a write not speculative, or a speculative one validation kept); None: ``version``."""
    shapes: list[torch.Size] = field(default_factory=list)
    """The parameters' shapes, read when the tier is built (weight-flow releases them later)."""
    starts: list[int] = field(default_factory=list)
    """Per position, its first element in the bucket's flat buffers."""
    views: dict[int, tuple[list[torch.Tensor], ...]] = field(default_factory=dict)
    """Per slot index, the bucket's views into it (made once: prepared kernel calls stay)."""
    prepared: dict[int, dict[Any, Any]] = field(default_factory=dict)
    """Per slot index, the bucket's prepared kernel calls (``steps.run_calls``)."""


class StateTier:
    """The file, the pool and the versions of one engine's tier buckets (module docstring)."""

    def __init__(self, plan: TierPlan, buffers: Sequence[BucketBuffers], *, io: Any,
                 file: Any, slots: Sequence[torch.Tensor], read_lane: Lane, write_lane: Lane,
                 recorder: Recorder, landed: Landed, watchdog_s: float,
                 track: Callable[[Future[Any]], Any],
                 raise_failed: Callable[[], None] = lambda: None,
                 moment_dtype: torch.dtype, grad_dtype: torch.dtype,
                 lp_dtype: torch.dtype | None, flow: bool,
                 stage: Sequence[torch.Tensor] = (),
                 alloc_host: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> None:
        self.plan, self.buffers, self.io, self.file = plan, buffers, io, file
        self.read_lane, self.write_lane, self.recorder = read_lane, write_lane, recorder
        self.landed, self.watchdog_s, self.track = landed, watchdog_s, track
        self.raise_failed = raise_failed
        """Raises the engine's first lane failure (runtime/errors.py ``FailureBox``): a bucket
        waiting for a buffer reports it as the engine's error, once."""
        self.path = str(getattr(file, "path", ""))
        self.lock_fd: int | None = None
        """An exclusive ``flock`` on the file while the engine runs (runtime/tier_open.py)."""
        self.pinned: list[torch.Tensor] = []
        """The allocations the pool was cut from, given back by ``close`` (``free_pinned``)."""
        self.free_pinned: Callable[[torch.Tensor], None] = lambda _: None
        self.moment_dtype, self.grad_dtype = moment_dtype, grad_dtype
        self.lp_dtype = lp_dtype
        self.books = {r.bucket: _Book(r) for r in plan.regions}
        self.slots = [Slot(k, t) for k, t in enumerate(slots)]
        self.order: list[int] = []
        """Tier buckets still to read ahead this iteration, first needed first."""
        self._cond = threading.Condition()
        self.read_bytes = 0
        self.write_bytes = 0
        """Bytes moved since the engine started (telemetry, the CLI summary)."""
        self.stall_s = 0.0
        """Seconds the training thread waited for a free slot (the tier's back-pressure)."""
        self.closed = False
        self.iteration = 0
        """The iteration the I/O belongs to (telemetry)."""
        self.error: BaseException | None = None
        """The first failed write or release: a bucket waiting for a slot raises it."""
        self.stage = list(stage)
        """Weight-flow's pinned staging buffers for homes in the file (``TierPlan.stage``)."""
        # built while every weight is in place (weight-flow releases them later)
        for b, book in self.books.items():
            book.shapes = [p.shape for p in buffers[b].params]
            book.starts = [0, *itertools.accumulate(s.numel() for s in book.shapes)][:-1]
            if flow and book.region.home_offset is None:
                # the kernel writes the copy straight into the home (plan/storage.py)
                assert lp_dtype is not None, "weight-flow homes in memory are the host copy"
                numel = book.region.numel
                # the engine's allocator pins on CUDA, so the publish's H2D copy is async
                if alloc_host is not None:
                    home = alloc_host(numel, lp_dtype)
                else:
                    home = torch.empty(numel, dtype=lp_dtype)
                book.home = split_views(home, book.shapes)
                buffers[b].lp_host = book.home

    # ------------------------------------------------------------------ queries
    def holds(self, b: int) -> bool:
        """Bucket ``b``'s state lives in the file."""
        return b in self.books

    @property
    def bucket_ids(self) -> tuple[int, ...]:
        return self.plan.tier

    def grad_spilled(self, b: int) -> bool:
        return self.books[b].grad_spilled

    def home(self, b: int) -> list[torch.Tensor]:
        home = self.books[b].home
        assert home is not None, "weight-flow homes are made when the tier is built"
        return home

    def home_in_file(self, b: int) -> bool:
        """Bucket ``b``'s weight-flow home lives in the file, in its state."""
        book = self.books.get(b)
        return book is not None and book.region.home_offset is not None

    # ------------------------------------------------------------------ read ahead
    def begin(self, iteration: int) -> None:
        """An iteration's last micro-step begins: read ahead every tier bucket in the order
        backward finishes them, as slots free up. The last iteration's spilled gradients are
        stale from here. ``iteration``: the number its storage spans carry."""
        with self._cond:
            self.iteration = iteration
            for book in self.books.values():
                book.grad_spilled = False
            # a bucket still bound from the last iteration is read again by its own bind
            bound = {s.owner for s in self.slots if s.owner is not None}
            self.order = [b for b in self.plan.tier if b not in bound]
        self._fill()

    def _fill(self) -> None:
        """Free slots take the next buckets of ``order`` and start reading them."""
        while True:
            with self._cond:
                if self.closed or not self.order:
                    return
                slot = next((s for s in self.slots if s.owner is None), None)
                if slot is None:
                    return
                b = self.order.pop(0)
                # assigned under the lock, read outside it: a read may wait for a write
                self._assign(b, slot, launched=False)
            self._submit_read(b, slot, grad=False, cast_lp=False)

    def _assign(self, b: int, slot: Slot, *, launched: bool) -> None:
        """Bucket ``b`` takes ``slot`` (under the lock)."""
        book = self.books[b]
        slot.owner, slot.launched, slot.loaded = b, launched, None
        book.slot = slot
        if slot.index not in book.views:
            book.views[slot.index] = self._views(b, slot)
            book.prepared[slot.index] = {}
        master, m, v, g, lp = book.views[slot.index]
        buf = self.buffers[b]
        buf.master, buf.exp_avg, buf.exp_avg_sq, buf.grad_host = master, m, v, g
        if self.lp_dtype is not None:
            # a weight-flow home in memory is the copy the kernel writes; else the slot's
            buf.lp_host = book.home if book.home is not None else lp
        buf.prepared = book.prepared[slot.index]

    def _views(self, b: int, slot: Slot) -> tuple[list[torch.Tensor], ...]:
        region, shapes = self.books[b].region, self.books[b].shapes
        n, mem, layout = region.numel, slot.memory, self.plan.slot
        # element sizes of the configured dtypes: the slot layout of plan/storage.py
        mb = torch.empty((), dtype=self.moment_dtype).element_size()
        gb = torch.empty((), dtype=self.grad_dtype).element_size()

        def part(offset: int, count: int, dtype: torch.dtype, size: int) -> list[torch.Tensor]:
            return split_views(mem[offset:offset + count * size].view(dtype), shapes)

        lp: list[torch.Tensor] = []
        if self.lp_dtype is not None and self.books[b].home is None:
            # a home in the file is part of the state (after v); else the slot's own copy
            at = layout.lp_offset if region.home_offset is None else region.home_offset
            lp = part(at, n, self.lp_dtype, 2)
        # master (fp32), exp_avg, exp_avg_sq back to back as plan/storage.py lays them out
        return (part(0, n, torch.float32, 4), part(4 * n, n, self.moment_dtype, mb),
                part((4 + mb) * n, n, self.moment_dtype, mb),
                part(layout.grad_offset, n, self.grad_dtype, gb), lp)

    def _submit_read(self, b: int, slot: Slot, *, grad: bool, cast_lp: bool) -> Future[Any]:
        last = self.books[b].last_write
        # every read of a bucket is ordered after its last write (the module docstring)
        after: tuple[Future[Any], ...] = ()
        if last is not None:
            after = (last,)
        fut = self.read_lane.submit(TierRead(b, self, slot, grad, cast_lp), after=after)
        slot.loaded = fut
        return fut

    # ------------------------------------------------------------------ binding
    def bind(self, b: int, *, read: bool = True, grad: bool = False,
             cast_lp: bool = False) -> Future[Any] | None:
        """Bucket ``b`` in a slot for work: its views point there. ``read``: the state in
        force is (being) read into it -- returns that read's future; ``grad``: the spilled
        gradient too; ``cast_lp``: the low-precision copy from the master (a republish).
        Blocks while every slot holds work, bounded by the watchdog."""
        book = self.books[b]
        with self._cond:
            slot = book.slot
            # its launch's write-back still runs: the next read must see what it writes
            if slot is not None and slot.launched:
                self._wait_released(b)
                slot = book.slot
            # read ahead: its state is (being) read already; the gradient or a cast is not
            if slot is not None and slot.loaded is not None and not (grad or cast_lp):
                slot.launched = True
                return slot.loaded if read else None
            # read ahead without the gradient: keep the slot, read again below
            if slot is not None:
                slot.launched = True
            else:
                if b in self.order:
                    self.order.remove(b)
                slot = self._take_slot(b)
        if not read:
            return None
        return self._submit_read(b, slot, grad=grad, cast_lp=cast_lp)

    def _wait_released(self, b: int) -> None:
        """Wait (under the lock) until bucket ``b``'s slot holding work has been freed."""
        t0 = self.recorder.now()
        while (slot := self.books[b].slot) is not None and slot.launched:
            if self.error is not None:
                self.raise_failed()
                raise StorageTierError(f"storage tier: bucket {b}'s write-back failed: "
                                       f"{self.error}") from self.error
            # a hung write must surface as an error, never as a silent stall
            if self.recorder.now() - t0 > self.watchdog_s:
                raise WatchdogTimeout(
                    f"storage tier: bucket {b}'s write-back did not end within "
                    f"OffloadConfig.watchdog_s={self.watchdog_s:g} s: lanes "
                    f"{self.write_lane.name}, {self.read_lane.name}")
            self._cond.wait(timeout=1.0)

    def _take_slot(self, b: int) -> Slot:
        """A slot for ``b`` (under the lock): a free one, else one only read ahead (its
        bucket goes back to the front of the order), else wait for a write to end."""
        waited = 0.0
        t0 = self.recorder.now()
        while True:
            free = next((s for s in self.slots if s.owner is None), None)
            if free is None:
                ahead = [s for s in self.slots if not s.launched and s.owner is not None]
                if ahead:
                    # the read ahead farthest from being needed gives way (launched work
                    # never does: its write-back owns the slot)
                    order = self.plan.tier
                    free = max(ahead, key=lambda s: order.index(s.owner))  # type: ignore[arg-type]
                    self._unassign(free, requeue=True)
            if free is not None:
                self._assign(b, free, launched=True)
                # backward (or the step) waited on the disk: it goes on the timeline
                if waited:
                    self.stall_s += waited
                    self.recorder.add(LANE_COMPUTE, KIND_WAIT, t0, self.recorder.now(),
                                      iteration=self.iteration, bucket=b)
                return free
            if self.error is not None:
                self.raise_failed()
                raise StorageTierError(f"storage tier: bucket {b} cannot get a buffer: a "
                                       f"write-back failed: {self.error}") from self.error
            if self.closed:
                raise EngineError("storage tier closed while a bucket waited for a slot")
            if waited >= self.watchdog_s:
                raise WatchdogTimeout(
                    f"storage tier: bucket {b} waited {waited:.0f} s for a free buffer "
                    f"(OffloadConfig.storage_buffer_count={len(self.slots)}); every buffer's "
                    f"write-back is late: lanes {self.write_lane.name}, {self.read_lane.name}")
            # woken by a release; the timeout re-checks the watchdog and a failed write
            self._cond.wait(timeout=min(1.0, self.watchdog_s))
            waited = self.recorder.now() - t0

    def _unassign(self, slot: Slot, *, requeue: bool) -> None:
        b = slot.owner
        assert b is not None
        pending = slot.loaded
        if pending is not None and not pending.done():
            # a read in flight into this slot: let it land before the slot changes hands,
            # without the lock (the read lane's task takes it when it counts its bytes)
            self._cond.release()
            try:
                pending.result(timeout=self.watchdog_s)
            finally:
                self._cond.acquire()
        self._unbind(b, slot)
        # it was the next needed: back to the front of the read-ahead order
        if requeue:
            self.order.insert(0, b)

    def _unbind(self, b: int, slot: Slot) -> None:
        book, buf = self.books[b], self.buffers[b]
        book.slot = None
        slot.owner, slot.launched, slot.loaded = None, False, None
        buf.master, buf.exp_avg, buf.exp_avg_sq, buf.grad_host = [], [], [], []
        if self.lp_dtype is not None and book.home is None:
            # empty, not None: "no copy" would change what the kernel writes
            buf.lp_host = []

    # ------------------------------------------------------------------ after the work
    def finish(self, b: int, *, after: Sequence[Future[Any]], step: Future[Any] | None,
               state: bool, grad: bool, published: Future[Any] | None, speculative: bool,
               d2h: Future[Any] | None = None) -> Future[Any]:
        """Bucket ``b``'s work in its slot is submitted: write back once ``after`` is done
        (``state``: the state, to the version not in force, if ``step`` ran; ``grad``: the
        gradient, once ``d2h`` has landed), then free the slot once ``published`` (the
        publish's device copy) has read it. ``speculative``: the written version waits for
        validation (``commit``/``discard``); else it is in force once written."""
        book = self.books[b]
        slot = book.slot
        assert slot is not None, f"bucket {b} finishes without a slot"
        # the write copies the slot: after the read into it, or it would write stale bytes
        deps = list(after)
        if slot.loaded is not None:
            deps.append(slot.loaded)
        if d2h is not None:
            deps.append(d2h)
        write = self.write_lane.submit(TierWrite(b, self, slot, step, state, grad, d2h),
                                       after=deps)
        with self._cond:
            book.last_write = write
            if speculative:
                book.speculative = write
            else:
                book.forced = write
        # the version flips in force only when the write has ended (a failed one changes none)
        if not speculative:
            write.add_done_callback(self._in_force(b))
        # the slot is free once written and once the publish's device copy has read it
        release_after = [write]
        if published is not None:
            release_after.append(published)
        done = self.write_lane.submit(TierRelease(b, self, slot, published), after=release_after)
        # the engine's synchronize() waits for it
        self.track(done)
        done.add_done_callback(self._note_failure)
        return done

    def _note_failure(self, fut: Future[Any]) -> None:
        """A write or release failed: its slot stays taken, so wake whoever waits for one."""
        exc = fut.exception()
        if exc is not None:
            with self._cond:
                if self.error is None:
                    self.error = exc
                self._cond.notify_all()

    def _in_force(self, b: int) -> Callable[[Future[Any]], None]:
        def apply(fut: Future[Any]) -> None:
            # a write of no state returns None: the version in force stays
            if fut.exception() is None and fut.result() is not None:
                with self._cond:
                    self.books[b].version = fut.result()
        return apply

    def commit(self, b: int) -> None:
        """Validation kept bucket ``b``'s speculative step: its written version is in force
        once the write has ended (every later read waits for it)."""
        with self._cond:
            write, self.books[b].speculative = self.books[b].speculative, None
            if write is not None:
                self.books[b].forced = write
        if write is not None:
            write.add_done_callback(self._in_force(b))

    def discard(self, b: int) -> None:
        """Validation rejected bucket ``b``'s speculative step: the version in force stays
        (the rollback, bit-exact: the written version is simply never read)."""
        with self._cond:
            self.books[b].speculative = None

    def release(self, b: int, slot: Slot, published: Future[Any] | None) -> None:
        """The write of ``b`` ended and its publish was enqueued: once the device copy has
        read the slot (``landed``), the slot is free for the next bucket."""
        # a failed publish copied nothing: nothing to wait for before reusing the slot
        if published is not None and published.exception() is None:
            self.landed(published.result())
        with self._cond:
            # the slot may already have changed hands (drop_read_ahead, close)
            if slot.owner == b:
                self._unbind(b, slot)
            self._cond.notify_all()
        self._fill()

    def drop_read_ahead(self) -> None:
        """Forget the reads ahead (the slots keep no work): before anything rewrites state
        outside a step (a load, adopted weights, a re-plan) or at a synchronize."""
        with self._cond:
            for slot in self.slots:
                if slot.owner is not None and not slot.launched:
                    self._unassign(slot, requeue=False)
            self.order = []
            self._cond.notify_all()

    # ------------------------------------------------------------------ the I/O (lanes)
    def read_into(self, b: int, slot: Slot, *, grad: bool, cast_lp: bool) -> None:
        book = self.books[b]
        region = book.region
        # the version in force as the training thread left it; read under the lock
        with self._cond:
            version = book.version
        nbytes = region.state_bytes + (region.grad_bytes if grad else 0)
        with self.recorder.span(LANE_STORAGE, KIND_TIER_READ, iteration=self.iteration,
                                bucket=b, nbytes=nbytes):
            reqs = [self.io.read(self.file, region.state_offsets[version],
                                 slot.memory[:region.state_bytes])]
            if grad:
                # begin() clears the flag: a gradient of the last iteration is stale
                if not book.grad_spilled:
                    raise StorageTierError(
                        f"storage tier: bucket {b}'s gradient was not kept in "
                        f"{self.file.path} and a step needs it")
                off = self.plan.slot.grad_offset
                reqs.append(self.io.read(self.file, region.grad_offset,
                                         slot.memory[off:off + region.grad_bytes]))
            for r in reqs:
                r.wait()
        with self._cond:
            self.read_bytes += nbytes
        if cast_lp and self.lp_dtype is not None:
            master, _, _, _, lp = book.views[slot.index]
            target = book.home if book.home is not None else lp
            with torch.no_grad():
                for d, s in zip(target, master):
                    # round to nearest even, as the kernel's fused copy
                    d.copy_(s)

    def write_from(self, b: int, slot: Slot, *, state: bool, grad: bool) -> int | None:
        book = self.books[b]
        region = book.region
        # always the version not in force: a rollback is the switch not made (bit-exact)
        with self._cond:
            version = 1 - book.version
        nbytes = (region.state_bytes if state else 0) + (region.grad_bytes if grad else 0)
        if not nbytes:
            return None
        with self.recorder.span(LANE_STORAGE, KIND_TIER_WRITE, iteration=self.iteration,
                                bucket=b, nbytes=nbytes):
            reqs = []
            if state:
                reqs.append(self.io.write(self.file, region.state_offsets[version],
                                          slot.memory[:region.state_bytes]))
            if grad:
                off = self.plan.slot.grad_offset
                reqs.append(self.io.write(self.file, region.grad_offset,
                                          slot.memory[off:off + region.grad_bytes]))
            for r in reqs:
                r.wait()
        with self._cond:
            self.write_bytes += nbytes
            if grad:
                book.grad_spilled = True
        return version if state else None

    # ------------------------------------------------------------------ weight-flow's reads
    def forced(self, b: int) -> Future[Any] | None:
        """What a reader of bucket ``b``'s version in force submitted now waits for
        (``version_in_force``): every decision on it was taken by the training thread."""
        with self._cond:
            return self.books[b].forced

    def version_in_force(self, b: int, forced: Future[Any] | None) -> int:
        """Bucket ``b``'s version in force once ``forced`` (``forced(b)`` when the reader was
        submitted) has ended: the version it wrote, else the one in force (a failed write
        changed nothing; the engine reports it). Its done-callback may not have run yet."""
        written = None
        if forced is not None:
            try:
                failed = forced.exception(timeout=self.watchdog_s)
            except TimeoutError:
                raise WatchdogTimeout(
                    f"storage tier: bucket {b}'s write did not end within OffloadConfig."
                    f"watchdog_s={self.watchdog_s:g} s before a weight fetch read it: lane "
                    f"{self.write_lane.name}") from None
            # a failed write changed nothing: the version in force stays
            written = forced.result() if failed is None else None
        with self._cond:
            # the done-callback may not have flipped ``version`` yet: the write's own answer
            return self.books[b].version if written is None else written

    def count_read(self, nbytes: int) -> None:
        """Bytes a weight fetch read from the file (telemetry, the CLI summary)."""
        with self._cond:
            self.read_bytes += nbytes

    @property
    def held_bytes(self) -> int:
        """Host bytes the tier holds: its pool, the staging buffers, the homes in memory."""
        homes = sum(t.numel() * t.element_size() for book in self.books.values()
                    for t in book.home or [])
        # the stage and the slots are byte tensors: numel() counts bytes
        stage_bytes = sum(t.numel() for t in self.stage)
        return stage_bytes + sum(s.memory.numel() for s in self.slots) + homes

    # ------------------------------------------------------------------ outside a step
    def wait_written(self, b: int) -> None:
        """Bucket ``b``'s last write has ended."""
        last = self.books[b].last_write
        if last is not None:
            last.result(timeout=self.watchdog_s)

    def wait_idle(self) -> None:
        """Every write submitted has ended and every slot holding work is free again."""
        writes = [book.last_write for book in self.books.values() if book.last_write is not None]
        for w in writes:
            w.result(timeout=self.watchdog_s)
        with self._cond:
            deadline_s = self.recorder.now() + self.watchdog_s
            while any(s.launched for s in self.slots):
                if self.recorder.now() > deadline_s:
                    raise WatchdogTimeout("storage tier: a buffer was not freed within "
                                          "OffloadConfig.watchdog_s after its write")
                self._cond.wait(timeout=1.0)

    def close(self) -> None:
        """Wait for the I/O in flight, then close and delete the file (scratch: the state a
        run resumes from is its checkpoint). Idempotent; never raises for the file."""
        with self._cond:
            if self.closed:
                return
        # a failed lane is the engine's to report, not close's
        with contextlib.suppress(Exception):
            self.drop_read_ahead()
            self.wait_idle()
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self.io.close()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None
        # the slots are free: no I/O or copy reads them any more
        for block in self.pinned:
            self.free_pinned(block)
        self.pinned = []
