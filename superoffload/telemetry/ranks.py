"""Several data-parallel ranks on one timeline (docs/jupyter.md, "Several data-parallel
ranks"): group, label, merge, save, load.

Each rank's engine records into its own `Recorder(rank=r)`, so every `Span` carries its rank
(events.py). These helpers keep the per-rank views apart: per-iteration metrics are computed
on ONE rank's spans (the interval algebra of metrics.py assumes one device and one CPU), and
a merged timeline draws one set of lanes per rank ("r0 d2h", "r1 d2h", ...). With a single
rank everything is what it was: labels are the bare lane names.

Clocks: a recorder's times are seconds since its own origin (time.perf_counter at creation).
Ranks that build their engines after the same barrier have origins within milliseconds of one
another; `merge_rank_spans(..., offsets_s=...)` shifts a source when that is not enough.
Files: `save_spans` writes one JSON object per line (Span.to_dict); `load_spans` reads them,
so each rank can write `spans-rank{r}.jsonl` and rank 0 (or a notebook) merges the files.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from superoffload.telemetry.events import LANES, SPAN_KINDS, Span
from superoffload.telemetry.metrics import (
    IterationMetrics,
    Summary,
    iteration_metrics,
    summarize_metrics,
)
from superoffload.telemetry.recorder import Recorder

SpanSource = Recorder | Sequence[Span] | str | Path


def ranks_of(spans: Iterable[Span]) -> list[int]:
    """The ranks present, ascending."""
    return sorted({s.rank for s in spans})


def by_rank(spans: Iterable[Span]) -> dict[int, list[Span]]:
    """Spans grouped by rank (ascending ranks, each group in the input order)."""
    out: dict[int, list[Span]] = {}
    for s in spans:
        out.setdefault(s.rank, []).append(s)
    return dict(sorted(out.items()))


def iteration_metrics_by_rank(spans: Sequence[Span]) -> dict[int, list[IterationMetrics]]:
    """`metrics.iteration_metrics` of each rank's own spans."""
    return {r: iteration_metrics(group) for r, group in by_rank(spans).items()}


def summarize_by_rank(spans: Sequence[Span], *, skip: int = 0) -> dict[int, Summary]:
    """`metrics.summarize_metrics` per rank (medians after `skip` warm-up iterations)."""
    return {r: summarize_metrics(m, skip=skip) for r, m in iteration_metrics_by_rank(spans).items()}


def lane_label(lane: str, rank: int, multi_rank: bool) -> str:
    """"r{rank} {lane}" when several ranks share the timeline, else the lane itself."""
    return f"r{rank} {lane}" if multi_rank else lane


def lane_rows(ranks: Sequence[int], lanes: Sequence[str] = LANES) -> list[tuple[int, str]]:
    """(rank, lane) of every timeline row, top to bottom: each rank's `lanes` (those a view
    draws, `events.lanes_in` of its spans) in LANES order."""
    return [(r, lane) for r in (ranks or [0]) for lane in lanes]


def row_index(span: Span, ranks: Sequence[int], lanes: Sequence[str] = LANES) -> int:
    """Timeline row of `span` in `lane_rows(ranks, lanes)` (rank-major, so a rank's lanes
    stay together); with one rank it is `lanes.index(span.lane)`."""
    k = ranks.index(span.rank) if len(ranks) > 1 else 0
    return k * len(lanes) + list(lanes).index(span.lane)


def span_from_dict(data: Mapping[str, Any]) -> Span:
    """Inverse of `Span.to_dict`; a missing rank reads as 0, unknown lanes/kinds raise."""
    names = {f.name for f in dataclasses.fields(Span)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"span_from_dict: unknown key(s) {unknown}; known: {sorted(names)}")
    if data.get("lane") not in LANES:
        raise ValueError(f"span_from_dict: lane={data.get('lane')!r} is not one of {LANES}")
    if data.get("kind") not in SPAN_KINDS:
        raise ValueError(f"span_from_dict: kind={data.get('kind')!r} is not one of {SPAN_KINDS}")
    return Span(
        lane=str(data["lane"]), kind=str(data["kind"]), start_s=float(data["start_s"]),
        end_s=float(data["end_s"]), iteration=int(data["iteration"]),
        bucket=int(data.get("bucket", -1)), nbytes=int(data.get("nbytes", 0)),
        rank=int(data.get("rank", 0)),
    )


def save_spans(spans: Iterable[Span], path: str | Path) -> Path:
    """Write spans as JSON lines (one `Span.to_dict()` per line); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in spans), encoding="utf-8")
    return out


def load_spans(path: str | Path) -> list[Span]:
    """Read spans written by `save_spans` (JSON lines), or a JSON list of span dicts."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return [span_from_dict(d) for d in json.loads(text)]
    return [span_from_dict(json.loads(line)) for line in text.splitlines() if line.strip()]


def _spans_of(source: SpanSource) -> list[Span]:
    if isinstance(source, Recorder):
        return source.spans()
    if isinstance(source, (str, Path)):
        return load_spans(source)
    spans = list(source)
    if any(not isinstance(s, Span) for s in spans):
        raise TypeError("merge_rank_spans: each source is a Recorder, a sequence of Span or a "
                        "path written by save_spans")
    return spans


def merge_rank_spans(sources: Sequence[SpanSource], *, ranks: Sequence[int] | None = None,
                     offsets_s: Sequence[float] | None = None) -> list[Span]:
    """One timeline from several ranks' recorders, span lists or files, sorted by start.

    ranks:     the rank of each source's spans (overrides what they carry; needed when the
               sources were recorded without a rank, e.g. all 0).
    offsets_s: seconds added to each source's times (align clocks; default 0).
    Two sources holding the same rank raise ValueError: the lanes would overlap."""
    if ranks is not None and len(ranks) != len(sources):
        raise ValueError(f"merge_rank_spans: {len(ranks)} ranks for {len(sources)} sources: "
                         "give one rank per source")
    if offsets_s is not None and len(offsets_s) != len(sources):
        raise ValueError(f"merge_rank_spans: {len(offsets_s)} offsets_s for {len(sources)} "
                         "sources: give one offset per source")
    merged: list[Span] = []
    owner: dict[int, int] = {}
    for k, source in enumerate(sources):
        spans = _spans_of(source)
        shift = float(offsets_s[k]) if offsets_s is not None else 0.0
        if ranks is not None or shift:
            spans = [dataclasses.replace(s, rank=int(ranks[k]) if ranks is not None else s.rank,
                                         start_s=s.start_s + shift, end_s=s.end_s + shift)
                     for s in spans]
        for r in {s.rank for s in spans}:
            if owner.setdefault(r, k) != k:
                raise ValueError(f"merge_rank_spans: sources {owner[r]} and {k} both hold rank "
                                 f"{r}: pass ranks=[...] to say which rank each source is")
        merged.extend(spans)
    merged.sort(key=lambda s: (s.start_s, s.rank, s.lane))
    return merged
