"""Thread-safe, bounded recorder of timeline spans, per-iteration scalars and notes.

Cheap when nobody reads it: recording is an append to a bounded deque under a lock.
Readers take snapshots (`spans()`, `spans_since(seq)`, `scalars_since(seq)`,
`notes_since(count)`), never live views, so the engine's threads never wait on a widget; a
reader that keeps up reads only what is new (a live dashboard's refresh costs what arrived
since the last one, not the run's length).

The buffer is bounded (`max_events` spans and scalars), but the run's start is not lost: an
iteration whose spans have all left the buffer is binned into `archive`
(telemetry/archive.py), and so are the scalars that left theirs. The binning runs in a
reader's thread when there is a reader (the dashboard's refresher), else in the recording
thread once `ARCHIVE_BATCH` spans have waited (a few ms every few hundred iterations).

Device-side work (forward, backward, transfers, the device optimizer step) is timed on the
device's clock: `mark(stream)` asks the recorder's `clock` for a point on the device
timeline and `add_marks` records the span between two marks once the device has reached
them (until then it waits in a pending list that `flush()` resolves; readers flush first).
The default `HostClock` marks host time, which is exact where the device is the CPU; the
CUDA engine installs `runtime.device_clock.CudaClock` (CUDA events aligned to this
recorder's clock), so "device idle" and "overlap" describe what the GPU did, not when the
host enqueued it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from superoffload.telemetry.archive import IterationArchive
from superoffload.telemetry.events import LANES, Span

ARCHIVE_BATCH = 4096
"""Spans that left the buffer and wait to be binned; past this the recording thread bins them
(no reader did)."""
LATE_ITERATIONS = 2
"""An iteration's last spans (its CPU tail, H2D) may be recorded this many iterations later:
an iteration is archived once the buffer's oldest span is this much newer."""


@dataclass(frozen=True, slots=True)
class Scalar:
    """A named number for one iteration (loss, loss scale, grad norm, ratio in force...)."""

    name: str
    iteration: int
    value: float
    time_s: float


@dataclass(frozen=True, slots=True)
class Note:
    """A plain-language event (e.g. "adaptive STV: speculation off, clipping in 6 of 20")."""

    iteration: int
    text: str
    time_s: float


class DeviceClock(Protocol):
    """Points on the device's timeline, read in a recorder's seconds."""

    def mark(self, stream: Any = None) -> Any:
        """A point after everything enqueued so far on ``stream`` (None: the current one)."""
        ...

    def seconds(self, mark: Any) -> float | None:
        """The mark's time in recorder seconds, or None while the device has not reached it."""
        ...


class HostClock:
    """Marks are host readings of the recorder's clock (a CPU "device": exact)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now

    def mark(self, stream: Any = None) -> float:
        return self.now()

    def seconds(self, mark: Any) -> float | None:
        return float(mark)


class Recorder:
    """Collects spans from any thread. `enabled=False` makes every call a no-op."""

    def __init__(self, *, enabled: bool = True, max_events: int = 200_000, rank: int = 0) -> None:
        if max_events < 1:
            raise ValueError(f"Recorder max_events={max_events} must be >= 1")
        self.enabled = enabled
        self.rank = rank
        self.max_events = max_events
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._spans: deque[tuple[int, Span]] = deque(maxlen=max_events)
        self._scalars: deque[tuple[int, Scalar]] = deque(maxlen=max_events)
        self._latest: dict[str, Scalar] = {}
        self._notes: deque[Note] = deque(maxlen=10_000)
        self._notes_total = 0
        self._seq = itertools.count()
        self._scalar_seq = itertools.count()
        self._last_seq = -1
        self._last_scalar_seq = -1
        self.archive = IterationArchive()
        """The run's iterations whose spans left the buffer, binned (module docstring)."""
        self._evicted: list[Span] = []
        self._context: list[Span] = []
        self._archiving = threading.Lock()
        self.clock: DeviceClock = HostClock(self.now)
        self._pending: list[tuple[str, str, Any, Any, int, int, int]] = []

    # ----------------------------------------------------------------- writing
    def now(self) -> float:
        """Seconds since this recorder's origin (time.perf_counter based)."""
        return time.perf_counter() - self._t0

    @property
    def origin_perf_counter_s(self) -> float:
        """The time.perf_counter() reading this recorder's times count from. On one host
        perf_counter is system-wide, so differences of origins align ranks' timelines."""
        return self._t0

    def record(self, span: Span) -> None:
        if not self.enabled:
            return
        if span.lane not in LANES:
            raise ValueError(f"Span.lane={span.lane!r} is not one of {LANES}")
        with self._lock:
            seq = next(self._seq)
            self._last_seq = seq
            if len(self._spans) == self.max_events:
                # the append below drops it
                self._evicted.append(self._spans[0][1])
            self._spans.append((seq, span))
            waiting = len(self._evicted)
        if waiting >= ARCHIVE_BATCH:
            self._archive()

    def add(
        self,
        lane: str,
        kind: str,
        start_s: float,
        end_s: float,
        *,
        iteration: int,
        bucket: int = -1,
        nbytes: int = 0,
    ) -> None:
        """Record a span from two `now()` readings."""
        if self.enabled:
            self.record(Span(lane, kind, start_s, end_s, iteration, bucket, nbytes, self.rank))

    @contextlib.contextmanager
    def span(
        self, lane: str, kind: str, *, iteration: int, bucket: int = -1, nbytes: int = 0
    ) -> Iterator[None]:
        """Time the body of a `with` block as one span (host clock)."""
        if not self.enabled:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            # in `finally`: a body that raises still leaves its span (the time it took counts)
            self.add(lane, kind, start, self.now(), iteration=iteration, bucket=bucket,
                     nbytes=nbytes)

    def mark(self, stream: Any = None) -> Any:
        """A point on the device timeline (see the module docstring)."""
        return self.clock.mark(stream) if self.enabled else None

    def add_marks(self, lane: str, kind: str, start: Any, end: Any, *, iteration: int,
                  bucket: int = -1, nbytes: int = 0) -> None:
        """Record the device span between two marks (now, or when the device reaches them)."""
        if not self.enabled:
            return
        t0, t1 = self.clock.seconds(start), self.clock.seconds(end)
        # already reached (always, on the host clock)
        if t0 is not None and t1 is not None:
            self.record(Span(lane, kind, t0, max(t0, t1), iteration, bucket, nbytes, self.rank))
            return
        with self._lock:
            self._pending.append((lane, kind, start, end, iteration, bucket, nbytes))

    @contextlib.contextmanager
    def device_span(self, lane: str, kind: str, *, stream: Any = None, iteration: int,
                    bucket: int = -1, nbytes: int = 0) -> Iterator[None]:
        """Time the device work enqueued on ``stream`` inside the block."""
        if not self.enabled:
            yield
            return
        start = self.clock.mark(stream)
        try:
            yield
        finally:
            self.add_marks(lane, kind, start, self.clock.mark(stream), iteration=iteration,
                           bucket=bucket, nbytes=nbytes)

    def flush(self) -> None:
        """Record every pending device span the device has finished (cheap; any thread)."""
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, []
        keep = []
        for item in pending:
            lane, kind, start, end, iteration, bucket, nbytes = item
            t0, t1 = self.clock.seconds(start), self.clock.seconds(end)
            if t0 is None or t1 is None:
                keep.append(item)
                continue
            self.record(Span(lane, kind, t0, max(t0, t1), iteration, bucket, nbytes, self.rank))
        if keep:
            with self._lock:
                self._pending[:0] = keep

    def scalar(self, name: str, iteration: int, value: float) -> None:
        if not self.enabled:
            return
        sc = Scalar(name, iteration, float(value), self.now())
        with self._lock:
            if len(self._scalars) == self.max_events:
                # leaves the buffer: binned, not lost
                old = self._scalars[0][1]
                self.archive.add_scalars([(old.name, old.iteration, old.value)])
            seq = next(self._scalar_seq)
            self._last_scalar_seq = seq
            self._scalars.append((seq, sc))
            self._latest[name] = sc

    def note(self, iteration: int, text: str) -> None:
        """Plain-language events are kept even when spans are disabled: they are rare."""
        with self._lock:
            self._notes.append(Note(iteration, text, self.now()))
            self._notes_total += 1

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
            self._spans.clear()
            self._scalars.clear()
            self._latest.clear()
            self._notes.clear()
            self._evicted, self._context = [], []
            self.archive = IterationArchive()

    def _archive(self) -> None:
        """Bin the iterations whose spans have all left the buffer (module docstring), in
        whichever thread calls it, off the recorder's lock; skipped while another thread is
        at it."""
        if self._archiving.acquire(blocking=False):
            try:
                self._archive_step()
            finally:
                self._archiving.release()

    def _archive_step(self) -> None:
        with self._lock:
            if not self._evicted or not self._spans:
                return
            through = self._spans[0][1].iteration - LATE_ITERATIONS - 1
            done = [s for s in self._evicted if s.iteration <= through + 1]
            self._evicted = [s for s in self._evicted if s.iteration > through]
        if not done:
            return
        # the previous batch's last iterations: their late CPU spans fall in these windows
        spans = [*self._context, *done]
        self.archive.add_spans(spans, after=self.archive.last_iteration, through=through)
        self._context = [s for s in spans if through - LATE_ITERATIONS < s.iteration <= through]

    # ----------------------------------------------------------------- reading
    @property
    def last_seq(self) -> int:
        """Sequence number of the newest span (-1 before the first)."""
        return self._last_seq

    def spans(self) -> list[Span]:
        """The spans the buffer holds, oldest first (the run's older iterations: `archive`)."""
        self.flush()
        self._archive()
        with self._lock:
            return [s for _, s in self._spans]

    def spans_since(self, seq: int) -> tuple[list[Span], int]:
        """Spans recorded after sequence number `seq`, and the newest sequence number.
        Cheap for a reader that keeps up: sequence numbers are consecutive in the buffer, so
        the new spans are its tail (a live dashboard asks twice a second of a buffer of
        ~10^5 spans)."""
        self.flush()
        self._archive()
        with self._lock:
            if not self._spans:
                return [], self._last_seq
            new = len(self._spans) - max(0, seq - self._spans[0][0] + 1)
            out = [s for _, s in itertools.islice(reversed(self._spans), max(new, 0))]
            out.reverse()
            return out, self._last_seq

    def scalars(self, name: str | None = None) -> list[Scalar]:
        """The scalars the buffer holds (all, or one name's), oldest first: a full pass; a
        reader that keeps up uses `scalars_since`."""
        with self._lock:
            return [s for _, s in self._scalars if name is None or s.name == name]

    def scalars_since(self, seq: int) -> tuple[list[Scalar], int]:
        """Scalars recorded after sequence number `seq`, and the newest sequence number (the
        tail of the buffer, as `spans_since`)."""
        with self._lock:
            if not self._scalars:
                return [], self._last_scalar_seq
            new = len(self._scalars) - max(0, seq - self._scalars[0][0] + 1)
            out = [s for _, s in itertools.islice(reversed(self._scalars), max(new, 0))]
            out.reverse()
            return out, self._last_scalar_seq

    def latest_scalar(self, name: str) -> Scalar | None:
        """The newest scalar of `name` (None before the first): one lookup, no pass."""
        with self._lock:
            return self._latest.get(name)

    def notes(self) -> list[Note]:
        with self._lock:
            return list(self._notes)

    def notes_since(self, count: int) -> tuple[list[Note], int]:
        """The notes after the first `count` ever recorded, and how many were recorded (the
        buffer keeps the newest 10,000)."""
        with self._lock:
            held = len(self._notes)
            new = min(held, max(0, self._notes_total - count))
            return list(itertools.islice(self._notes, held - new, held)), self._notes_total

    def spans_from_iteration(self, first: int) -> list[Span]:
        """The spans of iterations >= `first` the buffer holds, oldest first: read from the
        newest backwards, stopping where the buffer is older than `first` (a few iterations of
        late spans allowed), so the cost is what is returned, not the buffer's size."""
        self.flush()
        out: list[Span] = []
        with self._lock:
            for _, s in reversed(self._spans):
                if s.iteration < first - LATE_ITERATIONS:
                    break
                if s.iteration >= first:
                    out.append(s)
        out.reverse()
        return out

    def whole_run(self) -> tuple[IterationArchive, list[Span]]:
        """The whole run: a snapshot of `archive` and every span not in it (those still
        waiting to be binned, then the buffer's), oldest first. What a static figure, a CSV
        or a report of the run reads."""
        archive, spans, _seq = self.whole_run_seq()
        return archive, spans

    def whole_run_seq(self) -> tuple[IterationArchive, list[Span], int]:
        """`whole_run()` and the sequence number of its newest span, read at once: a reader
        continues with `spans_since(seq)`, nothing missed or read twice."""
        self.flush()
        # no batch half-way between the archive and the rest
        with self._archiving:
            self._archive_step()
            with self._lock:
                archive = self.archive.snapshot()
                done = archive.last_iteration
                waiting = [s for s in self._evicted if s.iteration > done]
                return archive, waiting + [s for _, s in self._spans], self._last_seq

    def iterations(self) -> list[int]:
        """Iterations with at least one span, ascending."""
        with self._lock:
            return sorted({s.iteration for _, s in self._spans})
