"""The storage tier's I/O engine against fio, on the same file (docs/storage.md, "I/O engine").

In one run, on one file in `--folder`: the project's engine (storage/aio.py, the same
`timed_pass` the planner's `measure_storage` uses) and fio (Debian's `fio`), with the same
file size, block size and queue depth, O_DIRECT, sequential writes then reads. fio uses the
kernel interface our engine runs on (io_uring or libaio). The two are interleaved round by
round (the order flipped every round) and the medians compared: the disk is shared and
virtual here, so one pass alone says little. Target: ours >= 85% of fio's each way.

    .venv/bin/python benchmarks/bench_storage.py                     # 1 GiB x 3 rounds, 1-2 min
    .venv/bin/python benchmarks/bench_storage.py --long              # 4 GiB x 5 rounds
    .venv/bin/python benchmarks/bench_storage.py --folder /nvme/tmp --queue-depth 64

`--training` adds the training row: the same model with its state in RAM and on the tier,
the ratio of median iteration times and the fraction of the tier's I/O hidden behind compute
(`--training-only`: that row alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from superoffload.storage import AioEngine, aligned_empty
from superoffload.storage.folder_speed import timed_pass


@dataclass(frozen=True)
class Row:
    name: str
    ours: float
    """Median GB/s (or, for the training row, median iteration seconds) of ours."""
    peer: float
    """The same for the peer (fio; for the training row, the run with the state in RAM)."""
    detail: str


def fio_gbps(path: Path, *, size_bytes: int, block_bytes: int, queue_depth: int, write: bool,
             ioengine: str) -> float:
    """One fio pass over the whole file; GB/s (1e9 bytes per second) as fio measured it."""
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--size={size_bytes}",
           f"--bs={block_bytes}", f"--iodepth={queue_depth}", "--direct=1",
           f"--rw={'write' if write else 'read'}", f"--ioengine={ioengine}", "--numjobs=1",
           "--allow_file_create=0", "--fallocate=none", "--output-format=json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"fio failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    return job["write" if write else "read"]["bw_bytes"] / 1e9


def io_rows(args: argparse.Namespace, folder: Path) -> list[Row]:
    size, block = args.size_mib << 20, args.block_kib << 10
    path = folder / f"bench-storage-{uuid.uuid4().hex[:8]}.bin"
    with AioEngine(queue_depth=args.queue_depth, block_bytes=block, thread_count=1,
                   direct="on", backend=args.backend) as engine:
        file = engine.open(path, size)
        try:
            # fio has no ring of threads: compare it on the interface our engine runs on
            ioengine = engine.backend if engine.backend != "threads" else "psync"
            buffer = aligned_empty(min(size, 64 << 20), pin=False)
            buffer.random_(0, 256)
            timed_pass(engine, file, buffer, write=True)  # untimed: the extents get written
            runs: dict[str, list[float]] = {k: [] for k in
                                            ("ours-write", "fio-write", "ours-read", "fio-read")}
            for r in range(args.rounds):
                for write in (True, False):
                    op = "write" if write else "read"
                    order = ("ours", "fio") if r % 2 == 0 else ("fio", "ours")
                    for who in order:
                        if who == "ours":
                            gbps = size / timed_pass(engine, file, buffer, write=write) / 1e9
                        else:
                            gbps = fio_gbps(path, size_bytes=size, block_bytes=block,
                                            queue_depth=args.queue_depth, write=write,
                                            ioengine=ioengine)
                        runs[f"{who}-{op}"].append(gbps)
                        print(f"  round {r + 1}/{args.rounds} {op:5s} {who:4s} {gbps:6.3f} GB/s",
                              flush=True)
        finally:
            path.unlink(missing_ok=True)
    rows = []
    for op in ("write", "read"):
        ours, peer = runs[f"ours-{op}"], runs[f"fio-{op}"]
        rows.append(Row(op, statistics.median(ours), statistics.median(peer),
                        f"ours {', '.join(f'{x:.3f}' for x in ours)}; fio "
                        f"{', '.join(f'{x:.3f}' for x in peer)} ({engine.backend}/{ioengine})"))
    return rows


def training_row(args: argparse.Namespace, folder: Path) -> Row:
    """The same model trained with its optimizer state in RAM (the peer) and on the tier in
    ``folder`` (ours): two engines on two copies of one GPT, their iterations interleaved
    (A, B, A, B... so the shared machine's load falls on both alike), medians after two
    warm-up iterations. The detail gives the fraction of the tier's I/O that overlapped
    compute or the CPU step (telemetry/storage_io.py) and the bytes it moved."""
    import torch

    import superoffload as so
    from superoffload.models.gpt import GPT, PRESETS
    from superoffload.telemetry.intervals import length
    from superoffload.telemetry.storage_io import storage_io

    torch.manual_seed(0)
    cfg = PRESETS[args.train_model]()
    batch, seq = args.train_batch, min(args.train_seq, cfg.block_size)
    data = [torch.randint(0, cfg.vocab_size, (batch, seq + 1)) for _ in range(4)]
    engines, configs = {}, {}
    for name, extra in (("ram", {}), ("tier", {"storage_path": str(folder / "tier"),
                                               "storage_buffer_count": 4})):
        torch.manual_seed(0)
        model = GPT(cfg).to(torch.bfloat16)
        configs[name] = so.OffloadConfig(device="cpu", ratio=1.0, bucket_bytes=args.train_bucket_mib
                                         << 20, **extra)  # no clipping: the steady state
        engines[name] = (model, so.initialize(model, {"lr": 1e-4}, configs[name]))
    times: dict[str, list[float]] = {"ram": [], "tier": []}
    for it in range(args.train_steps + 2):
        for name in (("ram", "tier") if it % 2 == 0 else ("tier", "ram")):
            model, engine = engines[name]
            x = data[it % len(data)]
            t0 = time.perf_counter()
            engine.backward(model(x[:, :-1], x[:, 1:]))
            engine.step()
            engine.zero_grad()
            engine.synchronize()
            if it >= 2:
                times[name].append(time.perf_counter() - t0)
    spans = engines["tier"][1].telemetry.spans()
    io = storage_io(spans)
    params = sum(p.numel() for p in engines["ram"][0].parameters())
    for _, engine in engines.values():
        engine.close()
    assert io is not None, "the tier engine recorded no storage span"
    busy = length((s.start_s, s.end_s) for s in spans if s.lane == "storage")
    hidden = 1.0 - io.exposed_s_per_iteration * io.iterations / busy if busy else 1.0
    predicted = predicted_ratio(cfg, batch, seq, configs, folder)
    detail = (f"GPT {args.train_model} ({params / 1e6:.0f} M params, bf16, {batch}x{seq} "
              f"tokens); I/O hidden {hidden:.0%}; {io.read_bytes_per_iteration / 1e9:.2f} GB "
              f"read + {io.write_bytes_per_iteration / 1e9:.2f} GB written per iteration at "
              f"{io.read_gbps:.2f} / {io.write_gbps:.2f} GB/s; the planner predicts tier/RAM "
              f"{predicted:.2f} on this machine's measured profile")
    return Row("training", statistics.median(times["tier"]), statistics.median(times["ram"]),
               detail)


def predicted_ratio(cfg: object, batch: int, seq: int, configs: dict, folder: Path) -> float:
    """The planner's iteration-time ratio tier / RAM for the training row's model, on this
    machine's measured profile with its tier measured in ``folder`` (plan.measure_local)."""
    import torch

    from superoffload import plan
    from superoffload.models.gpt import GPT
    from superoffload.plan.shapes import ModelShape

    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    shape = ModelShape.from_module(model, seq=seq, micro_batch=batch,
                                   activation_checkpointing=False)
    prof = plan.measure_local(quick=True, progress=False, storage=str(folder))
    times = {name: plan.simulate(shape, prof, "superoffload", config).iteration_s
             for name, config in configs.items()}
    return times["tier"] / times["ram"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=None,
                    help="where the file goes (default: a new folder in /var/tmp, on disk)")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--block-kib", type=int, default=1024, help="block size (fio --bs)")
    ap.add_argument("--queue-depth", type=int, default=32, help="blocks in flight (fio --iodepth)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="auto", choices=("auto", "io_uring", "libaio",
                                                          "threads"))
    ap.add_argument("--long", action="store_true", help="4 GiB x 5 rounds (several minutes)")
    ap.add_argument("--training", action="store_true",
                    help="also the training row (state in RAM vs on the tier)")
    ap.add_argument("--training-only", action="store_true", help="only the training row")
    ap.add_argument("--train-model", default="medium", help="GPT preset of the training row")
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=6, help="measured iterations per side")
    ap.add_argument("--train-bucket-mib", type=int, default=4)
    args = ap.parse_args()
    if args.long:
        args.size_mib, args.rounds = max(args.size_mib, 4096), max(args.rounds, 5)
    if shutil.which("fio") is None:
        sys.exit("bench_storage: fio is not installed (Debian: apt-get install fio)")
    base = args.folder or Path("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="superoffload-bench-", dir=base))
    print(f"{folder}: {args.size_mib} MiB, block {args.block_kib} KiB, queue depth "
          f"{args.queue_depth}, {args.rounds} rounds, O_DIRECT, sequential", flush=True)
    try:
        rows = [] if args.training_only else io_rows(args, folder)
        if args.training or args.training_only:
            rows.append(training_row(args, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("\n| op | ours | peer (fio; RAM) | ours/peer | detail |\n|---|---:|---:|---:|---|")
    for row in rows:
        unit = "s" if row.name == "training" else "GB/s"
        print(f"| {row.name} | {row.ours:.3f} {unit} | {row.peer:.3f} {unit} | "
              f"{row.ours / row.peer:.2f} | {row.detail} |")


if __name__ == "__main__":
    main()
