"""How far one training step travels through the code: files and cross-file calls.

Runs a few warm-up iterations of a tiny GPT under the engine, then traces one more
iteration (``engine.backward`` + ``engine.step`` + ``engine.zero_grad`` and the next
forward's waits) with ``sys.setprofile`` on every thread, the lanes included (the profiler is
installed before the engine starts its lane threads and records only around the traced
iteration), and prints the ``superoffload`` files it ran in (``models/`` left out: the model
is the user's) and the distinct cross-file calls (caller function -> callee function in
another file). From those it derives what docs/engine.md, "Reading one step", promises:

* files on the step, ``runtime/`` ones counted apart (the kernel's layers and the
  telemetry recorder are libraries the step calls);
* file pairs with a call, and *two-way* pairs: a call that returns into the file it came
  from (A calls B and B calls A), the doubling back a reader has to follow;
* files in a call cycle (strongly connected over file -> file; none: the files read in
  one order).

What it cannot see: calls entered through ``contextlib.contextmanager`` (``recorder.span``)
have contextlib as their caller, dataclass ``__init__``s run in ``<string>``, and callbacks
run by ``concurrent.futures`` or autograd have no caller of ours; their files still count.

With ``--fsdp`` the same iteration runs under the data-parallel engine
(``superoffload.distributed.fsdp.FsdpOffloadEngine``) on a gloo group of ``--ranks`` processes
(1: in this process; more: one process each, their traces merged): the step may then also run
in ``distributed/``, FSDP2's edge, counted apart.

    python scripts/step_trace.py            # the default engine: ratio 0.5, clipping on
    python scripts/step_trace.py --calls    # list every cross-file call too
    python scripts/step_trace.py --check    # exit 1 past the budgets (tests/test_architecture.py)
    python scripts/step_trace.py --fsdp --ranks 2   # the FSDP2 engine's step, 2 gloo ranks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PKG = str(ROOT / "superoffload") + os.sep
USER = ("models/",)
"""Files of the model the step trains, not of the engine."""
LIBRARIES = ("kernels/", "telemetry/recorder.py", "threads.py")
"""What the step may call outside ``runtime/``: the kernel's layers (with ``threads.py``, the
one thread rule their ``threads=None`` default resolves) and the telemetry recorder."""


EDGE = ("distributed/",)
"""Where the FSDP2 engine's step may run besides ``runtime/`` and its libraries: FSDP2's edge
(the transport's strategy, its hooks, the validation all-reduce, the collective guard)."""


def trace(fsdp: bool = False) -> tuple[list[str], list[tuple[str, str]]]:
    """(files in first-seen order, distinct cross-file calls "file:function") of one step;
    ``fsdp``: under the FSDP2 engine (torch.distributed must be initialised)."""
    import superoffload as so
    from superoffload.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]())
    x = torch.randint(0, model.config.vocab_size, (2, 32))
    cfg = so.OffloadConfig(device="cpu", ratio=0.5, bucket_bytes=64 * 1024, max_grad_norm=1.0,
                           cpu_threads=1)
    files: dict[str, None] = {}
    calls: dict[tuple[str, str], None] = {}
    lock = threading.Lock()
    active = [False]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not active[0]:
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PKG):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        with lock:
            files.setdefault(callee[len(PKG):])
            if caller.startswith(PKG) and caller != callee:
                calls.setdefault((f"{caller[len(PKG):]}:{frame.f_back.f_code.co_name}",
                                  f"{callee[len(PKG):]}:{frame.f_code.co_name}"))

    threading.setprofile(profile)  # before the lanes start: their threads are traced too
    try:
        with _engine(model, cfg, fsdp) as engine:
            for _ in range(3):  # warm-up: buckets built, kernels prepared, lanes started
                engine.backward(model(x, x))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
            sys.setprofile(profile)
            active[0] = True
            try:
                engine.backward(model(x, x))
                engine.step()
                engine.zero_grad()
                model(x, x)  # the next forward waits for the publishes
                engine.synchronize()
            finally:
                active[0] = False
                sys.setprofile(None)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    keep = [f for f in files if not f.startswith(USER)]
    edges = [(a, b) for a, b in calls
             if not a.startswith(USER) and not b.startswith(USER)]
    return keep, edges


def _engine(model: torch.nn.Module, cfg: Any, fsdp: bool) -> Any:
    import superoffload as so

    if not fsdp:
        return so.initialize(model, {"lr": 1e-3}, cfg)
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    return FsdpOffloadEngine(model, {"lr": 1e-3}, cfg)  # shards the model: the edge


def _rank_main(rank: int, world_size: int, port: int, outs: list[str]) -> None:
    """One rank of ``--ranks N``: trace the FSDP2 step, write (files, calls) to its JSON."""
    from superoffload.distributed import init_distributed, shutdown

    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    os.environ.update(env)  # the thread rule reads LOCAL_WORLD_SIZE from the environment
    init_distributed(backend="gloo", env=env, timeout_s=60)
    try:
        files, calls = trace(fsdp=True)
    finally:
        shutdown()
    Path(outs[rank]).write_text(json.dumps({"files": files, "calls": calls}))


def trace_fsdp(ranks: int) -> tuple[list[str], list[tuple[str, str]]]:
    """The FSDP2 step on ``ranks`` gloo ranks: in this process for 1, else one process each;
    the union of the ranks' files (first-seen order, rank 0 first) and calls."""
    if ranks == 1:
        from superoffload.distributed import init_distributed, shutdown

        init_distributed(backend="gloo", env={}, timeout_s=60)
        try:
            return trace(fsdp=True)
        finally:
            shutdown()
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(ranks)]
        mp.start_processes(_rank_main, args=(ranks, port, outs), nprocs=ranks, join=True,
                           start_method="spawn")
        traces = [json.loads(Path(o).read_text()) for o in outs]
    files = dict.fromkeys(f for t in traces for f in t["files"])
    calls = dict.fromkeys((a, b) for t in traces for a, b in t["calls"])
    return list(files), list(calls)


def file_of(call: str) -> str:
    return call.split(":", 1)[0]


def cycles(pairs: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected sets of more than one file (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in pairs:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", action="store_true", help="list the cross-file calls")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a budget below is exceeded, or the step leaves runtime/ "
                         "for anything but the kernel's layers and the recorder")
    ap.add_argument("--max-runtime-files", type=int, default=15)
    ap.add_argument("--max-calls", type=int, default=110, help="distinct cross-file calls")
    ap.add_argument("--max-two-way", type=int, default=0, help="file pairs calling both ways")
    ap.add_argument("--max-cycle-files", type=int, default=0, help="files in call cycles")
    ap.add_argument("--allow", action="append", default=[],
                    help="another file outside runtime/ the step may run in")
    ap.add_argument("--fsdp", action="store_true",
                    help="trace the FSDP2 engine's step (gloo); distributed/ is its edge")
    ap.add_argument("--ranks", type=int, default=1, help="--fsdp: gloo ranks (processes)")
    ap.add_argument("--max-edge-files", type=int, default=None,
                    help="--fsdp: files of distributed/ on the step")
    args = ap.parse_args(argv)
    files, calls = trace_fsdp(args.ranks) if args.fsdp else trace()
    pairs: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for a, b in calls:
        pairs[(file_of(a), file_of(b))].append((a, b))
    two_way = sorted((a, b) for a, b in pairs if a < b and (b, a) in pairs)
    loops = cycles(pairs)
    runtime = [f for f in files if f.startswith("runtime/")]
    edge = [f for f in files if f.startswith(EDGE)]
    other = [f for f in files if not f.startswith("runtime/")]
    step = f"{'FSDP2 ' if args.fsdp else ''}step"
    print(f"one {step}: {len(files)} files ({len(runtime)} in runtime/, {len(edge)} in "
          f"distributed/), {len(calls)} distinct cross-file calls, {len(pairs)} file pairs, "
          f"{len(two_way)} two-way, {sum(map(len, loops))} files in call cycles")
    for f in files:
        print(f"  {f}")
    for a, b in two_way:
        print(f"two-way: {a} <-> {b}")
        for x, y in pairs[(a, b)] + pairs[(b, a)]:
            print(f"    {x} -> {y}")
    for loop in loops:
        print(f"cycle: {', '.join(loop)}")
    if args.calls:
        for a, b in calls:
            print(f"  {a} -> {b}")
    if not args.check:
        return 0
    bad = []
    if len(runtime) > args.max_runtime_files:
        bad.append(f"{len(runtime)} runtime/ files > {args.max_runtime_files}")
    allowed = (*LIBRARIES, *(EDGE if args.fsdp else ()), *args.allow)
    stray = [f for f in other if not f.startswith(allowed)]
    if args.max_edge_files is not None and len(edge) > args.max_edge_files:
        bad.append(f"{len(edge)} distributed/ files > {args.max_edge_files}")
    if stray:
        bad.append(f"outside runtime/ and its libraries {LIBRARIES}: {stray}")
    if len(calls) > args.max_calls:
        bad.append(f"{len(calls)} cross-file calls > {args.max_calls}")
    if len(two_way) > args.max_two_way:
        bad.append(f"{len(two_way)} two-way file pairs > {args.max_two_way}")
    cyc = sum(map(len, loops))
    if cyc > args.max_cycle_files:
        bad.append(f"{cyc} files in call cycles > {args.max_cycle_files}")
    for b in bad:
        print(f"FAIL: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
