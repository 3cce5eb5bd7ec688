"""The OpenMP wait policy's cost (docs/kernel.md, "Threads, the work split
and the OpenMP wait policy").

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, at `import torch` (its copy serves our
kernel too), so each setting needs its own process: this script runs itself once per
setting and round, the settings interleaved round by round, and prints one row each. Every
child imports torch BEFORE superoffload (as a user's script often does), so the rows are:

* libgomp's default: torch first, our throttle opted out (SUPEROFFLOAD_OMP_THROTTLE=0):
  what such a process got before the spin throttle (kernels/openmp.py);
* torch first, throttled: what it gets now (kernels/openmp.py parks a pool, so libgomp
  spins at most 100 times per wait);
* OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=1000 set in the environment (the user's way).

Measured per row:

* our prepared step over 184 GPT-like tensors (26 M fp32 params), back to back;
* torch `AdamW(fused=True)` over the same tensors (an OpenMP region per tensor);
* our step over 64 Ki elements with 0.5 ms gaps between calls (as between buckets);
* a tiny GPT's forward + backward (many small torch ops);
* a tiny GPT's training iteration through the engine (tiny_cpu preset, 2 optimizer
  threads: forward, backward with the CPU worker stepping buckets, step);

medians, 2 threads, and the 1-minute load average (the machine is shared: FACTS.md).

    .venv/bin/python benchmarks/bench_kernel_openmp.py                  # 3 rounds
    .venv/bin/python benchmarks/bench_kernel_openmp.py --rounds 1 --schedule dynamic
    .venv/bin/python benchmarks/bench_kernel_openmp.py --compete 2      # a loaded host

--compete N runs N busy-loop processes beside each row (started before, stopped after it),
so the rows see a host whose cores are taken, whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"libgomp default (throttle off)": {"SUPEROFFLOAD_OMP_THROTTLE": "0"},
            "torch first, throttled": {},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"}}
CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SUPEROFFLOAD_OMP_THROTTLE")


def engine_iteration_ms(iterations: int = 25) -> float:
    """Median time of one training iteration of the tiny GPT through the engine."""
    import torch

    import superoffload as so
    from superoffload import presets
    from superoffload.models import GPT, gpt_tiny

    torch.manual_seed(0)
    model, x = GPT(gpt_tiny()), torch.randint(0, 256, (8, 64))
    engine = so.initialize(model, optimizer={"lr": 1e-3},
                           config=presets.tiny_cpu().replace(cpu_threads=2))
    times = []
    try:
        for _ in range(iterations):
            t0 = time.perf_counter()
            loss = model(x, x)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            float(loss.detach())  # a host sync, as in any loop that logs its loss
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return statistics.median(times[5:]) * 1e3


def measure(schedule: str) -> list[float]:
    """One process's row (run with the setting already in the environment)."""
    import torch

    import superoffload.kernels as K
    from superoffload.kernels.adam_bench import transformer_sizes
    from superoffload.models import GPT, gpt_tiny

    torch.set_num_threads(2)
    opts = K.ExecOptions(schedule=schedule)
    hyper = K.AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    sizes = transformer_sizes(26_000_000, layers=15)
    ps = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]
    ms, vs = [torch.zeros(n) for n in sizes], [torch.full((n,), 1e-6) for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.numel()) * 1e-3
    prep = K.prepare_adam(ps, [p.grad for p in ps], ms, vs)
    fused = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)
    for p, m, v in zip(ps, ms, vs):
        fused.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
    ours, theirs = [], []
    with torch.no_grad():
        for i in range(16):
            t0 = time.perf_counter()
            prep.step(hyper, step=2, threads=2, options=opts)
            t1 = time.perf_counter()
            fused.step()
            if i:  # the first round warms up
                ours.append(t1 - t0)
                theirs.append(time.perf_counter() - t1)
    n = 1 << 16
    small = K.prepare_adam([torch.randn(n)], [torch.randn(n)], [torch.zeros(n)], [torch.ones(n)])
    gaps = []
    for _ in range(300):
        t0 = time.perf_counter()
        small.step(hyper, step=1, threads=2, options=opts)
        gaps.append(time.perf_counter() - t0)
        time.sleep(0.0005)
    model, x = GPT(gpt_tiny()), torch.randint(0, 256, (8, 64))
    fb = []
    for _ in range(30):
        t0 = time.perf_counter()
        model(x, x).backward()
        fb.append(time.perf_counter() - t0)
    return [statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3,
            statistics.median(gaps) * 1e6, statistics.median(fb[5:]) * 1e3,
            engine_iteration_ms(), os.getloadavg()[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedule", choices=["static", "dynamic"], default="static")
    ap.add_argument("--compete", type=int, default=0,
                    help="busy-loop processes competing for the cores during each row")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        row = measure(args.schedule)
        import superoffload.kernels as K

        print(" ".join(f"{x:.6g}" for x in row) + " | " + K.wait_policy().value)
        return
    print(f"schedule={args.schedule}, torch imported first, {args.compete} competing busy "
          f"processes\n\n| setting | policy | ours 26 M, ms "
          "| torch fused 26 M, ms | ours 64 Ki, us | GPT tiny fwd+bwd, ms | GPT tiny engine "
          "iteration, ms | load |\n|---|---|---:|---:|---:|---:|---:|---:|")
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.compete)]
            try:
                out = subprocess.run([sys.executable, __file__, "--child", "--schedule",
                                      args.schedule], env={**base, **env}, capture_output=True,
                                     text=True, check=True)
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
            values, policy = out.stdout.strip().splitlines()[-1].split(" | ", 1)
            a, b, c, d, e, load = (float(x) for x in values.split())
            print(f"| {name} | {policy} | {a:.1f} | {b:.1f} | {c:,.0f} | {d:.1f} | {e:.1f} | "
                  f"{load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
