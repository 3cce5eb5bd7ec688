"""What the live dashboard costs the training it watches: one run, dashboard on and off.

The dashboard's refresher runs beside the training loop in the same process: every refresh
takes CPU and the GIL from the training thread and the engine's lanes. This trains the
tutorials' tiny GPT on the CPU (`presets.tiny_cpu`, 64 KiB buckets, batch 8 x 64 tokens) in
one engine and alternates blocks of `--block` iterations with the dashboard's refresher
stopped and started, off first and last (off on off on ... off): the same run, the same model,
interleaved. Each "on" block is compared with the "off" blocks on either side of it (the
mean of their medians), so a load that drifts cancels, and the change is the median of those
`--pairs` ratios with its sign-test interval (`telemetry.abtest.analyse`, the tuner's A/B
statistics): on a shared machine, whose noise only adds time, the interval says how much of
the figure is the dashboard.

Then, without training, what one refresh costs as a run grows (a recorder filled with a
recorded-like schedule of 500 to 16,000 iterations: the refresh's own CPU, `time.thread_time`,
median of 20) -- bounded by the bins, not the run's length -- and the longest time one
refresh holds the GIL: a probe thread sleeps 0.5 ms in a loop while refreshes run back to
back; its worst lateness beyond the sleep is the longest stretch another thread kept the
interpreter (the probe alone, without refreshes, is the baseline printed beside it).

    .venv/bin/python benchmarks/bench_dashboard.py              # ~2-3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_dashboard.py --pairs 10 --block 80 --hz 4

The dashboard is built as in a notebook (`live=True`: its widgets and the live figure); no
kernel or browser is attached, so each widget message is packed here as ipykernel's session
packs it for the browser (`jupyter_client.session.json_packer` of its content, its binary
buffers copied): what a kernel spends on a refresh's messages counts too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.widgets_support

import torch

import superoffload as so
from superoffload import data, plan
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.telemetry.abtest import analyse
from superoffload.telemetry.recorder import Recorder
from superoffload.widgets import LiveDashboard
from tests.widgets_support import record_iteration

BATCH, SEQ = 8, 64


def kernel_like_comms() -> None:
    """Widgets' comms pack their messages as a kernel's session would (module docstring)."""
    import comm
    from comm.base_comm import BaseComm
    from jupyter_client.session import json_packer

    class PackingComm(BaseComm):
        def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None,
                        buffers: Any = None, **keys: Any) -> None:
            json_packer({"data": data, "comm_id": self.comm_id, **keys})
            for b in buffers or ():
                bytes(b)  # zmq copies a small frame; the cost of a large one is alike

    comm.create_comm = lambda **kw: PackingComm(**kw)


def build() -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    config = so.presets.tiny_cpu().replace(bucket_bytes=64 * 1024)
    engine = so.initialize(model, optimizer={"lr": 3e-3, "weight_decay": 0.0}, config=config)
    tokens, _ = data.split_train_val(data.load_tokens())
    batches = data.BatchSampler(tokens, batch_size=BATCH, seq_len=SEQ, seed=0)
    shape = plan.ModelShape.from_module(model, seq=SEQ, micro_batch=BATCH)
    return model, engine, batches, shape


def block(model: Any, engine: Any, batches: Any, n: int) -> list[float]:
    """Seconds of each of `n` iterations."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        x, y = batches.next_batch()
        loss = model(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def overhead(pairs: int, block_n: int, hz: float, warmup: int) -> None:
    model, engine, batches, shape = build()
    dash = LiveDashboard(engine, shape=shape, live=True, refresh_hz=hz)
    block(model, engine, batches, warmup)
    dash.start()  # the first refresh reads the run so far and predicts: not in a block
    time.sleep(1.0)
    dash.stop()
    on: list[list[float]] = []
    off: list[list[float]] = [block(model, engine, batches, block_n)]
    for _ in range(pairs):
        dash.start()
        on.append(block(model, engine, batches, block_n))
        dash.stop()
        off.append(block(model, engine, batches, block_n))
    refresher = getattr(dash, "_refresher", None)
    cpu = list(getattr(refresher, "cpu_s", []))
    engine.close()
    res = analyse(off, on, changes={"dashboard": ("off", "on")})
    print(f"iteration time, {pairs} pairs of {block_n}-iteration blocks (off on off ... off), "
          f"refresh at {hz:g} Hz ({dash.refreshes} refreshes):")
    print(f"  dashboard off {res.old_ms:8.2f} ms median   dashboard on {res.new_ms:8.2f} ms")
    print(f"  on / off      {1 + res.change:8.3f}    ({res.confidence:.0%} interval "
          f"{1 + res.ci[0]:.3f} .. {1 + res.ci[1]:.3f}; target <= 1.05)")
    if cpu:
        print(f"  refresh CPU   {statistics.median(cpu) * 1e3:8.2f} ms median, "
              f"{max(cpu) * 1e3:.2f} ms max (the refresher's own thread)")


def filled(iterations: int) -> Recorder:
    rec = Recorder(max_events=30 * iterations + 100)
    t = 0.0
    for it in range(iterations):
        t = record_iteration(rec, it, t, loss=5.0 - it * 1e-4, ratio=0.5) + 0.001
        rec.scalar("iteration_s", it, 0.033)
    return rec


def refresh_cost(sizes: list[int]) -> None:
    print("one refresh as the run grows (CPU of the refreshing thread, median of 20):")
    for n in sizes:
        rec = filled(n)
        dash = LiveDashboard(rec, live=True)
        dash.refresh()
        t = 0.0 + 0.034 * n
        times = []
        for k in range(20):
            t = record_iteration(rec, n + k, t, loss=1.0, ratio=0.5) + 0.001
            c0 = time.thread_time()
            dash.refresh()
            times.append(time.thread_time() - c0)
        print(f"  {n:6d} iterations recorded: {statistics.median(times) * 1e3:7.2f} ms")


def gil_hold(iterations: int, seconds: float) -> None:
    rec = filled(iterations)
    dash = LiveDashboard(rec, live=True)
    dash.refresh()

    def probe(stop: threading.Event, late: list[float]) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0005)
            late.append(time.perf_counter() - t0 - 0.0005)

    def busy_python() -> None:  # the peer: pure Python, which lets go every switch interval
        x = 0
        for i in range(200_000):
            x += i * i

    def run(work: Any) -> list[float]:
        stop, late = threading.Event(), [0.0]
        th = threading.Thread(target=probe, args=(stop, late))
        th.start()
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            work()
        stop.set()
        th.join()
        return sorted(late)

    clock = [0.034 * iterations, iterations]

    def one_refresh() -> None:
        clock[0] = record_iteration(rec, clock[1], clock[0], loss=1.0) + 0.001
        clock[1] += 1
        dash.refresh()

    peer, held = run(busy_python), run(one_refresh)

    def q(xs: list[float], f: float) -> float:
        return xs[min(len(xs) - 1, int(f * len(xs)))] * 1e3

    print(f"the GIL, seen by a thread that sleeps 0.5 ms in a loop ({iterations} iterations "
          f"recorded; switch interval {sys.getswitchinterval() * 1e3:.0f} ms): its lateness "
          f"p50 / p99 / max")
    print(f"  beside back-to-back refreshes   {q(held, .5):6.1f} / {q(held, .99):6.1f} / "
          f"{held[-1] * 1e3:6.1f} ms")
    print(f"  beside pure-Python work (peer)  {q(peer, .5):6.1f} / {q(peer, .99):6.1f} / "
          f"{peer[-1] * 1e3:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--block", type=int, default=80, help="iterations per block")
    ap.add_argument("--hz", type=float, default=2.0, help="the dashboard's refresh_hz")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--sizes", default="500,2000,8000,16000")
    ap.add_argument("--skip-training", action="store_true")
    args = ap.parse_args()
    kernel_like_comms()

    if not args.skip_training:
        overhead(args.pairs, args.block, args.hz, args.warmup)
    refresh_cost([int(s) for s in args.sizes.split(",")])
    gil_hold(8000, 3.0)


if __name__ == "__main__":
    main()
