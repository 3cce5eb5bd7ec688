"""How far one training step travels through the code: files and cross-file calls.

Runs a few warm-up iterations of a tiny GPT under the engine, then traces one more
iteration (``engine.backward`` + ``engine.step`` + ``engine.zero_grad`` and the next
forward's waits) with ``sys.setprofile`` on every thread, and prints the ``superoffload``
files it ran in and the distinct cross-file calls (caller function -> callee function in
another file), in first-seen order. A reading aid for docs/engine.md's reading order, and the
measure behind "one step in at most ~12 files".

    python scripts/step_trace.py            # the default engine: ratio 0.5, clipping on
    python scripts/step_trace.py --calls    # list every cross-file call too
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PKG = str(ROOT / "superoffload") + os.sep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", action="store_true", help="list the cross-file calls")
    args = ap.parse_args(argv)
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

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if not callee.startswith(PKG):
            return
        with lock:
            files.setdefault(callee[len(PKG):])
            if caller.startswith(PKG) and caller != callee:
                calls.setdefault((f"{caller[len(PKG):]}:{frame.f_back.f_code.co_name}",
                                  f"{callee[len(PKG):]}:{frame.f_code.co_name}"))

    with so.initialize(model, {"lr": 1e-3}, cfg) as engine:
        for _ in range(3):  # warm-up: buckets built, kernels prepared, lanes started
            engine.backward(model(x, x))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            engine.backward(model(x, x))
            engine.step()
            engine.zero_grad()
            model(x, x)  # the next forward waits for the publishes
            engine.synchronize()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    print(f"one step: {len(files)} files, {len(calls)} distinct cross-file calls")
    for f in files:
        print(f"  {f}")
    if args.calls:
        for a, b in calls:
            print(f"  {a} -> {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
