"""Chrome / Perfetto trace export: the engine's (or the simulator's) spans as a trace file.

    write_chrome_trace(engine.telemetry, "runs/latest/trace.json")   # or a list of Span

Open the file in https://ui.perfetto.dev (drag and drop) or chrome://tracing. The format is
the Trace Event Format's JSON object form, the one PyTorch's profiler (kineto) writes:

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

  tracks     one process per rank ("superoffload rank r"), one thread per lane in LANES order
             (metadata events, ph "M": process_name, thread_name, thread_sort_index); a lane
             whose spans partially overlap (they cannot nest) spills onto "lane (2)", ...
  spans      complete events (ph "X"), `ts` and `dur` in microseconds since the recorder's
             origin, `args` = iteration, bucket, bytes, rank
  flows      per (rank, iteration, bucket): arrows D2H -> CPU step (-> rollback -> replay)
             -> H2D, as pairs of flow events (ph "s" then "f", same `id` and `cat`) bound to
             the enclosing slice ("bp": "e"), which is how kineto links a CPU launch to its
             GPU kernel
  iterations one slice per iteration window on an "iterations" track (telemetry.metrics)
  counters   recorder scalars (loss, ratio, ...) and per-iteration link GB/s while moving and
             overlap % (ph "C")
  notes      the engine's plain-language notes as global instant events (ph "i", "s": "g")

`check_chrome_trace(data)` lists what would stop a viewer from loading a file (used by tests).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from superoffload.telemetry import metrics
from superoffload.telemetry.events import (
    KIND_CPU_STEP,
    KIND_D2H,
    KIND_H2D,
    KIND_REPLAY,
    KIND_ROLLBACK,
    LANES,
    Span,
)
from superoffload.telemetry.recorder import Note, Recorder, Scalar

US = 1e6
"""Trace timestamps are microseconds."""
FLOW_CAT = "bucket"
"""Category of the bucket flows (flow ids are unique within a category)."""
ITERATION_TID = 0
_FLOW_KINDS = (KIND_D2H, KIND_CPU_STEP, KIND_ROLLBACK, KIND_REPLAY, KIND_H2D)
_LANE_NAMES = {
    "device_compute": "device compute", "d2h": "D2H (grads out)", "cpu_optimizer": "CPU optimizer",
    "h2d": "H2D (weights in)", "device_optimizer": "device optimizer",
}
_MIN_DUR_US = 0.001  # a zero-length span still needs a body for a flow to bind to


def write_chrome_trace(source: Recorder | Sequence[Span], path: str | Path) -> Path:
    """Write `source` (a Recorder: spans, scalars and notes; or spans of one or several ranks)
    as a Chrome trace JSON file; parent folders are created. Returns the path."""
    spans, scalars, notes = _gather(source)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(spans, scalars=scalars, notes=notes)), encoding="utf-8")
    return out


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
    slices: dict[int, dict[str, Any]] = {}  # id(span) -> its X event (flows bind to it)
    for rank in ranks:
        mine = [s for s in spans if s.rank == rank]
        events.extend(_iteration_slices(rank, mine))
        for lane_pos, lane in enumerate(LANES):
            tracks = assign_tracks([s for s in mine if s.lane == lane])
            for depth, track in enumerate(tracks):
                tid = 1 + lane_pos + 100 * depth
                name = _LANE_NAMES[lane] + (f" ({depth + 1})" if depth else "")
                events.append(_meta(rank, tid, "thread_name", {"name": name}))
                events.append(_meta(rank, tid, "thread_sort_index", {"sort_index": tid}))
                for s in track:
                    ev = _slice(s, tid)
                    slices[id(s)] = ev
                    events.append(ev)
        events.extend(_counters(rank, mine))
    events.extend(_flows(spans, slices))
    for sc in scalars:
        if math.isfinite(sc.value):
            events.append({"ph": "C", "name": sc.name, "pid": ranks[0], "tid": ITERATION_TID,
                           "ts": _us(sc.time_s), "args": {sc.name: sc.value}})
    for n in notes:
        events.append({"ph": "i", "s": "g", "name": n.text, "cat": "note", "pid": ranks[0],
                       "tid": ITERATION_TID, "ts": _us(n.time_s), "args": {"iteration": n.iteration}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "superoffload", "clock": "seconds since the recorder's origin",
                      "lanes": list(LANES)},
    }


def assign_tracks(spans: Iterable[Span]) -> list[list[Span]]:
    """Spread one lane's spans over tracks so that on each track every two spans are either
    disjoint or nested (what a trace viewer can draw); the first track takes all it can."""
    tracks: list[list[Span]] = []
    stacks: list[list[float]] = []  # per track: ends of the slices still open
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


def _iteration_slices(rank: int, spans: Sequence[Span]) -> list[dict[str, Any]]:
    out = []
    for m in metrics.iteration_metrics(spans):
        out.append({"ph": "X", "name": f"iteration {m.iteration}", "cat": "iteration", "pid": rank,
                    "tid": ITERATION_TID, "ts": _us(m.start_s),
                    "dur": max(_us(m.start_s + m.wall_s) - _us(m.start_s), _MIN_DUR_US),
                    "args": {"wall_ms": m.wall_s * 1e3, "rollbacks": m.rollbacks,
                             "replays": m.replays}})
    return out


def _counters(rank: int, spans: Sequence[Span]) -> list[dict[str, Any]]:
    out = []
    for m in metrics.iteration_metrics(spans):
        ts = _us(m.start_s)
        out.append({"ph": "C", "name": "link GB/s while moving", "pid": rank, "ts": ts,
                    "args": {"D2H": m.d2h_gbps_busy, "H2D": m.h2d_gbps_busy}})
        out.append({"ph": "C", "name": "overlap and idle %", "pid": rank, "ts": ts,
                    "args": {"CPU step hidden": 100 * m.cpu_overlap_frac,
                             "device idle": 100 * m.device_idle_frac}})
    return out


def _flows(spans: Sequence[Span], slices: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Arrows between consecutive pieces of one bucket's round trip, in time order."""
    chains: dict[tuple[int, int, int], list[Span]] = {}
    for s in spans:
        if s.bucket >= 0 and s.kind in _FLOW_KINDS and id(s) in slices:
            chains.setdefault((s.rank, s.iteration, s.bucket), []).append(s)
    out: list[dict[str, Any]] = []
    flow_id = 0
    for (_rank, iteration, bucket), chain in sorted(chains.items()):
        chain.sort(key=lambda s: (s.start_s, _FLOW_KINDS.index(s.kind)))
        for a, b in zip(chain, chain[1:]):
            flow_id += 1
            name = f"bucket {bucket} it {iteration}"
            for ph, span in (("s", a), ("f", b)):
                ev = slices[id(span)]
                out.append({"ph": ph, "id": flow_id, "cat": FLOW_CAT, "name": name,
                            "pid": ev["pid"], "tid": ev["tid"], "bp": "e",
                            "ts": round(ev["ts"] + ev["dur"] / 2, 3)})
    return out


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
        elif ph == "C" and not all(isinstance(v, (int, float)) for v in ev.get("args", {}).values()):
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
