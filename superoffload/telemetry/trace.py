"""Chrome / Perfetto trace export: the engine's (or the simulator's) spans as a trace file.

    write_chrome_trace(engine.telemetry, "runs/latest/trace.json")   # or a list of Span
    export = prepare_chrome_trace(engine.telemetry, every=10)        # a long run: sample it
    print(export.describe())                                         # its size, before writing
    export.write("runs/latest/trace.json")

Open the file in https://ui.perfetto.dev (drag and drop) or chrome://tracing. The format is
the Trace Event Format's JSON object form, the one PyTorch's profiler (kineto) writes:

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

  tracks     one process per rank ("superoffload rank r"), one thread per lane the spans use
             (`events.lanes_in`: a storage lane only for a run that read or wrote storage), in
             LANES order
             (metadata events, ph "M": process_name, thread_name, thread_sort_index); a lane
             whose spans partially overlap (they cannot nest) spills onto "lane (2)", ...
  spans      complete events (ph "X"), `ts` and `dur` in microseconds since the recorder's
             origin, `args` = iteration, bucket, bytes, rank
  flows      per (rank, iteration, bucket): arrows backward -> D2H -> CPU step (-> rollback
             -> replay) -> H2D, as pairs of flow events (ph "s" then "f", same `id` and `cat`)
             bound to the enclosing slice ("bp": "e"), which is how kineto links a CPU launch
             to its GPU kernel; the backward end sits where that bucket's copy started (its
             gradients were complete there)
  iterations one slice per iteration window on an "iterations" track (telemetry.metrics),
             its args the iteration's figures in the metric vocabulary (iteration_ms, ...)
  counters   recorder scalars (loss, ratio, ... in the vocabulary's names and units: the
             engine's iteration_s becomes iteration_ms) and per-iteration link GB/s while
             moving and overlap % (ph "C"), one counter track per metric titled "label (unit)"
  notes      the engine's plain-language notes as global instant events (ph "i", "s": "g")

Sampling: a trace of every iteration of a long run is large (~250 bytes per span: a 36 s
notebook run is ~9 MB). `every=N` keeps every Nth iteration, `last=K` the last K (both: every
Nth of the last K); `prepare_chrome_trace` returns the text and says its size before anything
is written. `check_chrome_trace(data)` lists what would stop a viewer from loading a file
(used by tests).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from superoffload.telemetry import metrics
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.events import (
    KIND_BACKWARD,
    KIND_CPU_STEP,
    KIND_D2H,
    KIND_H2D,
    KIND_REPLAY,
    KIND_ROLLBACK,
    LANE_LABELS,
    LANES,
    Span,
    lanes_in,
)
from superoffload.telemetry.recorder import Note, Recorder, Scalar

US = 1e6
"""Trace timestamps are microseconds."""
FLOW_CAT = "bucket"
"""Category of the bucket flows (flow ids are unique within a category)."""
ITERATION_TID = 0
_FLOW_KINDS = (KIND_D2H, KIND_CPU_STEP, KIND_ROLLBACK, KIND_REPLAY, KIND_H2D)
# a zero-length span still needs a body for a flow to bind to
_MIN_DUR_US = 0.001


@dataclass(frozen=True, slots=True)
class PreparedTrace:
    """A trace ready to write: its JSON text and what it holds."""

    text: str
    iterations: int
    """Iterations in the trace."""
    total_iterations: int
    """Iterations recorded (before sampling)."""
    sampling: str
    """"every iteration", "every 10th iteration", "the last 200 iterations", ..."""

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))

    def describe(self) -> str:
        """"trace of 120 of 1,200 iterations (every 10th iteration): 0.91 MB"."""
        return (f"trace of {self.iterations:,} of {self.total_iterations:,} iterations "
                f"({self.sampling}): {self.nbytes / 1e6:.2f} MB")

    def write(self, path: str | Path) -> Path:
        """Write the file (parent folders are created); returns its path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.text, encoding="utf-8")
        return out


def sample_iterations(iterations: Iterable[int], *, every: int = 1,
                      last: int | None = None) -> set[int]:
    """The iterations a sampled trace keeps: of the last `last` (None: all), every `every`-th
    counted from the first kept one."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every={every!r}: keep every Nth iteration, N a whole number >= 1")
    if last is not None and (not isinstance(last, int) or isinstance(last, bool) or last < 1):
        raise ValueError(f"last={last!r}: keep the last K iterations, K a whole number >= 1 "
                         "(None: all)")
    its = sorted(set(iterations))
    if last is not None:
        its = its[-last:]
    return set(its[::every])


def prepare_chrome_trace(source: Recorder | Sequence[Span], *, every: int = 1,
                         last: int | None = None) -> PreparedTrace:
    """The trace of `source` (see `write_chrome_trace`), sampled (`sample_iterations`), as
    text: `.describe()` says its size, `.write(path)` writes it."""
    spans, scalars, notes = _gather(source)
    total = {s.iteration for s in spans}
    keep = sample_iterations(total, every=every, last=last)
    if len(keep) < len(total):
        spans = [s for s in spans if s.iteration in keep]
        scalars = [s for s in scalars if s.iteration in keep]
        notes = [n for n in notes if n.iteration in keep or n.iteration not in total]
    parts = []
    if every > 1:
        parts.append(f"every {_ordinal(every)} iteration")
    if last is not None:
        parts.append(f"of the last {last}")
    text = json.dumps(chrome_trace(spans, scalars=scalars, notes=notes))
    return PreparedTrace(text, len(keep), len(total), " ".join(parts) or "every iteration")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def write_chrome_trace(source: Recorder | Sequence[Span], path: str | Path, *, every: int = 1,
                       last: int | None = None) -> Path:
    """Write `source` (a Recorder: spans, scalars and notes; or spans of one or several ranks)
    as a Chrome trace JSON file, sampled as `sample_iterations` says; parent folders are
    created. Returns the path."""
    return prepare_chrome_trace(source, every=every, last=last).write(path)


def _gather(source: Recorder | Sequence[Span]) -> tuple[list[Span], list[Scalar], list[Note]]:
    if isinstance(source, Recorder):
        return source.spans(), source.scalars(), source.notes()
    if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
        raise TypeError(f"write_chrome_trace: pass a Recorder or a sequence of Span, not "
                        f"{type(source).__name__}")
    spans = list(source)
    bad = [type(s).__name__ for s in spans if not isinstance(s, Span)]
    if bad:
        raise TypeError(f"write_chrome_trace: every item must be a telemetry Span, got {bad[0]}")
    return spans, [], []


def chrome_trace(spans: Sequence[Span], *, scalars: Sequence[Scalar] = (),
                 notes: Sequence[Note] = ()) -> dict[str, Any]:
    """The trace as a JSON-ready dict (see the module docstring)."""
    events: list[dict[str, Any]] = []
    ranks = sorted({s.rank for s in spans}) or [0]
    for rank in ranks:
        events.append(_meta(rank, None, "process_name", {"name": f"superoffload rank {rank}"}))
        events.append(_meta(rank, None, "process_sort_index", {"sort_index": rank}))
        events.append(_meta(rank, ITERATION_TID, "thread_name", {"name": "iterations"}))
        events.append(_meta(rank, ITERATION_TID, "thread_sort_index", {"sort_index": 0}))
    # id(span) -> its X event (flows bind to it)
    slices: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        mine = [s for s in spans if s.rank == rank]
        # one pass of the metrics per rank: the iteration slices and the counters share it
        per_iter = [(m, vocab.iteration_values(m)) for m in metrics.iteration_metrics(mine)]
        events.extend(_iteration_slices(rank, per_iter))
        for lane in lanes_in(mine):
            tracks = assign_tracks([s for s in mine if s.lane == lane])
            for depth, track in enumerate(tracks):
                # a lane keeps its place in any run
                tid = 1 + LANES.index(lane) + 100 * depth
                name = LANE_LABELS[lane] + (f" ({depth + 1})" if depth else "")
                events.append(_meta(rank, tid, "thread_name", {"name": name}))
                events.append(_meta(rank, tid, "thread_sort_index", {"sort_index": tid}))
                for s in track:
                    ev = _slice(s, tid)
                    slices[id(s)] = ev
                    events.append(ev)
        events.extend(_counters(rank, per_iter))
    events.extend(_flows(spans, slices))
    for sc in scalars:
        name, value = vocab.engine_scalar(sc.name, sc.value)
        if math.isfinite(value):
            title = vocab.METRICS[name].title if name in vocab.METRICS else name
            events.append({"ph": "C", "name": title, "pid": ranks[0], "tid": ITERATION_TID,
                           "ts": _us(sc.time_s), "args": {name: value}})
    for n in notes:
        events.append({"ph": "i", "s": "g", "name": n.text, "cat": "note", "pid": ranks[0],
                       "tid": ITERATION_TID, "ts": _us(n.time_s),
                       "args": {"iteration": n.iteration}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "superoffload", "clock": "seconds since the recorder's origin",
                      "lanes": list(lanes_in(spans))},
    }


def assign_tracks(spans: Iterable[Span]) -> list[list[Span]]:
    """Spread one lane's spans over tracks so that on each track every two spans are either
    disjoint or nested (what a trace viewer can draw); the first track takes all it can."""
    tracks: list[list[Span]] = []
    # per track: ends of the slices still open
    stacks: list[list[float]] = []
    for s in sorted(spans, key=lambda x: (x.start_s, -x.end_s)):
        for track, stack in zip(tracks, stacks):
            while stack and stack[-1] <= s.start_s:
                stack.pop()
            if not stack or s.end_s <= stack[-1]:
                track.append(s)
                stack.append(s.end_s)
                break
        else:
            tracks.append([s])
            stacks.append([s.end_s])
    return tracks


def _us(seconds: float) -> float:
    return round(seconds * US, 3)


def _meta(pid: int, tid: int | None, name: str, args: dict[str, Any]) -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _slice(s: Span, tid: int) -> dict[str, Any]:
    name = s.kind if s.bucket < 0 else f"{s.kind} b{s.bucket}"
    return {"ph": "X", "name": name, "cat": s.lane, "pid": s.rank, "tid": tid,
            "ts": _us(s.start_s), "dur": max(_us(s.end_s) - _us(s.start_s), _MIN_DUR_US),
            "args": {"iteration": s.iteration, "bucket": s.bucket, "bytes": s.nbytes}}


PerIteration = Sequence[tuple[metrics.IterationMetrics, dict[str, float]]]
"""One rank's iterations with their vocabulary values (`vocabulary.iteration_values`)."""


def _iteration_slices(rank: int, per_iter: PerIteration) -> list[dict[str, Any]]:
    out = []
    for m, values in per_iter:
        out.append({"ph": "X", "name": f"iteration {m.iteration}", "cat": "iteration", "pid": rank,
                    "tid": ITERATION_TID, "ts": _us(m.start_s),
                    "dur": max(_us(m.start_s + m.wall_s) - _us(m.start_s), _MIN_DUR_US),
                    "args": {k: v for k, v in values.items() if math.isfinite(v)}})
    return out


COUNTERS = ("d2h_gbps_busy", "h2d_gbps_busy", "cpu_step_hidden_pct", "device_idle_pct")
"""Per-iteration counters of the trace (one track each, titled by the vocabulary)."""


def _counters(rank: int, per_iter: PerIteration) -> list[dict[str, Any]]:
    out = []
    for m, values in per_iter:
        for name in COUNTERS:
            if math.isfinite(values[name]):
                out.append({"ph": "C", "name": vocab.METRICS[name].title, "pid": rank,
                            "ts": _us(m.start_s), "args": {name: values[name]}})
    return out


def _flows(spans: Sequence[Span], slices: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Arrows between consecutive pieces of one bucket's round trip, in time order, starting
    at the backward pass that completed its gradients."""
    chains: dict[tuple[int, int, int], list[Span]] = {}
    backward: dict[tuple[int, int], list[Span]] = {}
    for s in spans:
        if id(s) not in slices:
            continue
        if s.bucket >= 0 and s.kind in _FLOW_KINDS:
            chains.setdefault((s.rank, s.iteration, s.bucket), []).append(s)
        elif s.kind == KIND_BACKWARD:
            backward.setdefault((s.rank, s.iteration), []).append(s)
    out: list[dict[str, Any]] = []
    flow_id = 0
    for (rank, iteration, bucket), chain in sorted(chains.items()):
        chain.sort(key=lambda s: (s.start_s, _FLOW_KINDS.index(s.kind)))
        name = f"bucket {bucket} it {iteration}"
        source = _producer(backward.get((rank, iteration), []), chain[0])
        if source is not None:
            flow_id += 1
            bw, first = slices[id(source)], slices[id(chain[0])]
            # at the gradient's completion: where this bucket's copy started, inside backward
            at = min(max(first["ts"], bw["ts"]), round(bw["ts"] + bw["dur"], 3))
            out.append(_flow("s", flow_id, name, bw, at))
            out.append(_flow("f", flow_id, name, first, round(first["ts"] + first["dur"] / 2, 3)))
        for a, b in zip(chain, chain[1:]):
            flow_id += 1
            for ph, span in (("s", a), ("f", b)):
                ev = slices[id(span)]
                out.append(_flow(ph, flow_id, name, ev, round(ev["ts"] + ev["dur"] / 2, 3)))
    return out


def _producer(backward: list[Span], first: Span) -> Span | None:
    """The backward span that produced a bucket whose round trip starts with `first` (a D2H,
    or a CPU step on a device with no link): the one running when it started, else the last
    one before it."""
    if first.kind != KIND_D2H:
        return None
    before = [b for b in backward if b.start_s <= first.start_s]
    return max(before, key=lambda b: b.start_s) if before else None


def _flow(ph: str, flow_id: int, name: str, slice_ev: dict[str, Any], ts: float) -> dict[str, Any]:
    return {"ph": ph, "id": flow_id, "cat": FLOW_CAT, "name": name, "pid": slice_ev["pid"],
            "tid": slice_ev["tid"], "bp": "e", "ts": ts}


# ------------------------------------------------------------------ checking a file


def check_chrome_trace(data: Any) -> list[str]:
    """What would stop a trace viewer from loading `data` (a parsed trace file): missing or
    mistyped fields, negative durations, slices that overlap without nesting on a track,
    flows without both ends or whose ends are not inside a slice of their track. Empty when
    the trace is valid."""
    problems: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return ["the top level must be an object with a 'traceEvents' list"]
    tracks: dict[tuple[Any, Any], list[tuple[float, float]]] = {}
    flows: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for k, ev in enumerate(data["traceEvents"]):
        ph = ev.get("ph") if isinstance(ev, dict) else None
        if ph not in ("X", "M", "C", "i", "s", "t", "f"):
            problems.append(f"event {k}: unknown or missing ph {ph!r}")
            continue
        if "pid" not in ev or "name" not in ev:
            problems.append(f"event {k} ({ph}): needs 'pid' and 'name'")
        if ph != "M" and not isinstance(ev.get("ts"), (int, float)):
            problems.append(f"event {k} ({ph}): 'ts' must be a number of microseconds")
            continue
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"event {k}: complete event needs 'dur' >= 0, got {dur!r}")
                continue
            tracks.setdefault((ev["pid"], ev.get("tid")), []).append((ev["ts"], ev["ts"] + dur))
        elif ph in ("s", "t", "f"):
            flows.setdefault((str(ev.get("cat")), ev.get("id")), []).append(ev)
        elif ph == "C" and not all(isinstance(v, (int, float))
                                   for v in ev.get("args", {}).values()):
            problems.append(f"event {k}: counter args must be numbers")
    for key, slices in tracks.items():
        stack: list[float] = []
        for start, end in sorted(slices, key=lambda iv: (iv[0], -iv[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1] + 1e-6:
                problems.append(f"track {key}: slice [{start}, {end}] overlaps its parent "
                                f"without nesting")
            stack.append(end)
    for flow_key, points in flows.items():
        phases = sorted(ev["ph"] for ev in points)
        if phases.count("s") != 1 or phases.count("f") != 1:
            problems.append(f"flow {flow_key}: needs one 's' and one 'f', got {phases}")
        for ev in points:
            inside = any(s <= ev["ts"] <= e for s, e in tracks.get((ev["pid"], ev.get("tid")), []))
            if not inside:
                problems.append(f"flow {flow_key} ({ev['ph']}) at {ev['ts']} is inside no slice of "
                                f"its track ({ev['pid']}, {ev.get('tid')})")
    return problems
