"""Pure encoding of the timeline panel: spans in, plot-ready arrays in milliseconds out.

x is milliseconds since the start of the oldest iteration shown (its first device-compute
span): a window of a few iterations reads as "0 .. 60 ms", not as seconds since the engine
started. Each iteration's start is a boundary line labelled "it N". One line trace per lane
holds all its spans (NaN-separated segments: a fixed number of traces keeps a live update
cheap); rollbacks, replays, skipped steps and reconfigurations are separate marker sets.
The rows are the lanes the data has (`events.lanes_in`; a live view passes every lane its run
has used so far, so rows do not come and go between refreshes): a run that reads state from
storage gets a "storage I/O" row, one that does not gets none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from superoffload.telemetry import ranks as rank_util
from superoffload.telemetry.events import (
    KIND_REPLAY,
    KIND_ROLLBACK,
    LANE_COMPUTE,
    LANE_LABELS,
    LANES,
    Span,
    lanes_in,
)


@dataclass(frozen=True, slots=True)
class Segments:
    """Spans of one lane as one line trace: x = [start, end, NaN, ...] in ms."""

    x_ms: np.ndarray
    y: np.ndarray
    text: list[str]

    @property
    def count(self) -> int:
        """Number of spans drawn."""
        return len(self.text) // 3


@dataclass(frozen=True, slots=True)
class Markers:
    x_ms: np.ndarray
    y: np.ndarray
    text: list[str]

    @property
    def count(self) -> int:
        return len(self.text)


def _markers(items: Sequence[tuple[float, float, str]]) -> Markers:
    return Markers(np.array([x for x, _, _ in items], dtype=float),
                   np.array([y for _, y, _ in items], dtype=float), [t for _, _, t in items])


@dataclass(frozen=True, slots=True)
class TimelineView:
    origin_s: float
    """Seconds (recorder clock) of x = 0 ms."""
    lanes: dict[str, Segments]
    """Lane -> its spans, for every lane of `LANES` (empty for a lane without rows)."""
    rows_lanes: tuple[str, ...]
    """The lanes with a row, top to bottom (per rank when several ranks share the view)."""
    boundaries: dict[int, float]
    """Iteration -> x (ms) of its start."""
    rollbacks: Markers
    replays: Markers
    skipped: Markers
    reconfigures: Markers
    labels: list[str]
    """Row labels, top to bottom."""
    x_range_ms: tuple[float, float]

    @property
    def rows(self) -> int:
        return len(self.labels)


def span_segments(spans: Sequence[Span], rows: Sequence[int], origin_s: float) -> Segments:
    """Encode spans as one line trace with NaN breaks; span k sits on row `rows[k]`."""
    n = len(spans)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    if n:
        x[0::3] = [(s.start_s - origin_s) * 1e3 for s in spans]
        x[1::3] = [(s.end_s - origin_s) * 1e3 for s in spans]
        y[0::3] = rows
        y[1::3] = rows
    text: list[str] = []
    for s in spans:
        label = f"{s.kind} · it {s.iteration}"
        if s.bucket >= 0:
            label += f" · bucket {s.bucket}"
        label += f" · {s.duration_s * 1e3:.2f} ms"
        if s.nbytes:
            label += f" · {s.nbytes / 1e6:.2f} MB"
            if s.duration_s > 0 and s.lane in ("d2h", "h2d"):
                label += f" · {s.nbytes / s.duration_s / 1e9:.2f} GB/s"
        text.extend((label, label, ""))
    return Segments(x, y, text)


def iteration_starts(spans: Iterable[Span]) -> dict[int, float]:
    """Iteration -> its first device-compute span's start (seconds): the metrics' window."""
    out: dict[int, float] = {}
    for s in spans:
        if s.lane == LANE_COMPUTE and (s.iteration not in out or s.start_s < out[s.iteration]):
            out[s.iteration] = s.start_s
    return dict(sorted(out.items()))


MARK_OFFSET = {KIND_ROLLBACK: -0.22, KIND_REPLAY: 0.22}
"""Rows (fractions of a lane) by which rollback and replay markers sit off their lane's middle."""


def spaced_labels(starts: dict[int, float], x_range_ms: tuple[float, float],
                  min_frac: float = 0.05) -> dict[int, float]:
    """The iteration starts to label "it N": each at least `min_frac` of the x range after the
    previous label (close iterations would print on top of each other), the first always."""
    width = max(x_range_ms[1] - x_range_ms[0], 1e-12)
    out: dict[int, float] = {}
    last = None
    for it, x in sorted(starts.items(), key=lambda kv: kv[1]):
        if last is None or x - last >= min_frac * width:
            out[it] = x
            last = x
    return out


def vlines(xs: Sequence[float], y0: float, y1: float) -> tuple[np.ndarray, np.ndarray]:
    """Vertical segments at `xs` from y0 to y1 as one NaN-separated line trace."""
    x = np.repeat(np.asarray(xs, dtype=float), 3)
    y = np.tile([y0, y1, np.nan], len(xs)).astype(float)
    if len(xs):
        x[2::3] = np.nan
    return x, y


def timeline_view(spans: Sequence[Span], *, skipped: Iterable[int] = (),
                  reconfigures: Sequence[tuple[int, str]] = (),
                  origin_s: float | None = None,
                  lanes: Iterable[str] | None = None) -> TimelineView:
    """Everything the timeline panel draws for `spans` (one or several ranks); rows for
    `lanes` (default: those `spans` use) and any other lane `spans` use, in LANES order."""
    ranks = rank_util.ranks_of(spans) or [0]
    multi = len(ranks) > 1
    starts = iteration_starts(spans)
    if origin_s is None:
        origin_s = min(starts.values(), default=min((s.start_s for s in spans), default=0.0))
    wanted = set(lanes or ()) | set(lanes_in(spans))
    rows_lanes = tuple(lane for lane in LANES if lane in wanted)

    def row(s: Span) -> int:
        return rank_util.row_index(s, ranks, rows_lanes)

    by_lane: dict[str, Segments] = {}
    for lane in LANES:
        mine = [s for s in spans if s.lane == lane]
        by_lane[lane] = span_segments(mine, [row(s) for s in mine], origin_s)
    ms = {it: (t - origin_s) * 1e3 for it, t in starts.items()}
    marks: dict[str, list[tuple[float, float, str]]] = {KIND_ROLLBACK: [], KIND_REPLAY: []}
    for s in spans:
        if s.kind in marks:
            mid = ((s.start_s + s.end_s) / 2 - origin_s) * 1e3
            rank = f"r{s.rank} " if multi else ""
            # a replay follows its rollback on the same lane: above / below the row's middle,
            # so the two markers never cover each other
            y = row(s) + MARK_OFFSET[s.kind]
            marks[s.kind].append((mid, y, f"{rank}{s.kind} · it {s.iteration} · bucket {s.bucket}"))
    skipped_marks = [(ms[it], -0.35, f"it {it}: step skipped (non-finite gradient)")
                     for it in sorted(set(skipped)) if it in ms]
    reconf_marks = [(ms[it], -0.35, f"it {it}: {text}") for it, text in reconfigures if it in ms]
    end = max((s.end_s for s in spans), default=origin_s)
    labels = [rank_util.lane_label(LANE_LABELS[lane], r, multi)
              for r, lane in rank_util.lane_rows(ranks, rows_lanes)]
    return TimelineView(
        origin_s=origin_s, lanes=by_lane, rows_lanes=rows_lanes, boundaries=ms,
        rollbacks=_markers(marks[KIND_ROLLBACK]), replays=_markers(marks[KIND_REPLAY]),
        skipped=_markers(skipped_marks), reconfigures=_markers(reconf_marks), labels=labels,
        x_range_ms=(min(0.0, min(ms.values(), default=0.0)), max((end - origin_s) * 1e3, 1e-3)),
    )
