"""Thread-safe, bounded recorder of timeline spans, per-iteration scalars and notes.

Cheap when nobody reads it: recording is an append to a bounded deque under a lock.
Readers take snapshots (`spans()`, `spans_since(seq)`), never live views, so the engine's
threads never wait on a widget.

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

from superoffload.telemetry.events import LANES, Span


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
        self._scalars: deque[Scalar] = deque(maxlen=max_events)
        self._notes: deque[Note] = deque(maxlen=10_000)
        self._seq = itertools.count()
        self._last_seq = -1
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
            self._spans.append((seq, span))

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
            self.add(lane, kind, start, self.now(), iteration=iteration, bucket=bucket, nbytes=nbytes)

    def mark(self, stream: Any = None) -> Any:
        """A point on the device timeline (see the module docstring)."""
        return self.clock.mark(stream) if self.enabled else None

    def add_marks(self, lane: str, kind: str, start: Any, end: Any, *, iteration: int,
                  bucket: int = -1, nbytes: int = 0) -> None:
        """Record the device span between two marks (now, or when the device reaches them)."""
        if not self.enabled:
            return
        t0, t1 = self.clock.seconds(start), self.clock.seconds(end)
        if t0 is not None and t1 is not None:  # already reached (always, on the host clock)
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
        if self.enabled:
            with self._lock:
                self._scalars.append(Scalar(name, iteration, float(value), self.now()))

    def note(self, iteration: int, text: str) -> None:
        """Plain-language events are kept even when spans are disabled: they are rare."""
        with self._lock:
            self._notes.append(Note(iteration, text, self.now()))

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
            self._spans.clear()
            self._scalars.clear()
            self._notes.clear()

    # ----------------------------------------------------------------- reading
    @property
    def last_seq(self) -> int:
        """Sequence number of the newest span (-1 before the first)."""
        return self._last_seq

    def spans(self) -> list[Span]:
        self.flush()
        with self._lock:
            return [s for _, s in self._spans]

    def spans_since(self, seq: int) -> tuple[list[Span], int]:
        """Spans recorded after sequence number `seq`, and the newest sequence number.
        Cheap for a reader that keeps up: sequence numbers are consecutive in the buffer, so
        the new spans are its tail (a live dashboard asks twice a second of a buffer of
        ~10^5 spans)."""
        self.flush()
        with self._lock:
            if not self._spans:
                return [], self._last_seq
            new = len(self._spans) - max(0, seq - self._spans[0][0] + 1)
            out = [s for _, s in itertools.islice(reversed(self._spans), max(new, 0))]
            out.reverse()
            return out, self._last_seq

    def scalars(self, name: str | None = None) -> list[Scalar]:
        with self._lock:
            return [s for s in self._scalars if name is None or s.name == name]

    def notes(self) -> list[Note]:
        with self._lock:
            return list(self._notes)

    def iterations(self) -> list[int]:
        """Iterations with at least one span, ascending."""
        with self._lock:
            return sorted({s.iteration for _, s in self._spans})
