"""The start of a long run, binned: what the recorder keeps of the iterations whose spans it
no longer holds.

The recorder keeps a bounded buffer of spans (`Recorder(max_events=...)`, ~8,300 iterations
of a small model at the default). Its oldest spans are not dropped: when an iteration's spans
have all left the buffer, that iteration's figures (`vocabulary.iteration_values`, weighted
as `telemetry.window.WEIGHTS` pools them) and its start time go into even bins
(`telemetry.binned.Binned`, at most `ARCHIVE_BINS` per figure), as do the scalars that left
theirs (loss, ratio, ...). The static figure, the CSV and the report join these bins with
what the buffer still holds, so they cover the whole run at any length: the start binned,
never dropped (docs/jupyter.md, "Long runs").

`archive_spans` is the pure step (spans in, bins out); the recorder calls it off its lock on
the iterations that are complete (the next iteration's spans left the buffer too, so every
window is measured as the live view measured it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.binned import Binned
from superoffload.telemetry.events import Span
from superoffload.telemetry.metrics import iteration_metrics
from superoffload.telemetry.window import WEIGHTS

ARCHIVE_BINS = 1000
"""Bins per figure in the archive (a static figure shows at most `STATIC_POINTS` anyway)."""
TIME_KEY = "time_s"
"""The archive's series of iteration start times (recorder seconds): the wall-clock axis."""


class IterationArchive:
    """Binned figures of the iterations a recorder let go (module docstring). Thread-safe."""

    def __init__(self, max_bins: int = ARCHIVE_BINS) -> None:
        self.max_bins = max_bins
        self.series: dict[str, Binned] = {
            name: Binned(max_bins) for name in (*vocab.PER_ITERATION, TIME_KEY)}
        """Figure name (and `TIME_KEY`) -> its bins."""
        self.scalars: dict[str, Binned] = {}
        """Scalar name -> its bins (of the scalars that left the recorder's buffer)."""
        self.last_iteration = -1
        """The newest iteration archived (-1: none)."""
        self._lock = threading.Lock()

    @property
    def iterations(self) -> int:
        """Iterations archived."""
        return self.series[TIME_KEY].count

    def add_spans(self, spans: Sequence[Span], *, after: int, through: int) -> None:
        """Archive the iterations `after` < i <= `through` of `spans`, which hold every span of
        them, the next iteration's (so each window ends where the live view's did) and the
        previous ones' late spans (CPU work inside these windows)."""
        points = [m for m in iteration_metrics(spans) if after < m.iteration <= through]
        with self._lock:
            for m in points:
                values = vocab.iteration_values(m)
                for name, series in self.series.items():
                    if name == TIME_KEY:
                        series.add(m.iteration, m.start_s)
                    else:
                        series.add(m.iteration, values[name], WEIGHTS[name](m))
                self.last_iteration = max(self.last_iteration, m.iteration)

    def add_scalars(self, scalars: Iterable[tuple[str, int, float]]) -> None:
        """Archive (name, iteration, value) scalars."""
        with self._lock:
            for name, iteration, value in scalars:
                series = self.scalars.get(name)
                if series is None:
                    series = self.scalars[name] = Binned(self.max_bins)
                series.add(iteration, value)

    def snapshot(self) -> IterationArchive:
        """A copy a reader can use while the recorder archives more."""
        out = IterationArchive(self.max_bins)
        with self._lock:
            out.series = {k: _copy(v) for k, v in self.series.items()}
            out.scalars = {k: _copy(v) for k, v in self.scalars.items()}
            out.last_iteration = self.last_iteration
        return out


def _copy(b: Binned) -> Binned:
    out = Binned(b.max_bins)
    out.merge(b)
    return out
