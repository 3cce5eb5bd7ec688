"""The OpenMP wait policy's cost (docs/kernel.md, "Threads"; issue 11 §4).

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, at `import torch` (its copy serves our
kernel too), so each setting needs its own process: this script runs itself once per
setting and round, the settings interleaved round by round, and prints one row each:

* our prepared step over 184 GPT-like tensors (26 M fp32 params), back to back;
* torch `AdamW(fused=True)` over the same tensors (an OpenMP region per tensor);
* our step over 64 Ki elements with 0.5 ms gaps between calls (as between buckets);
* a tiny GPT's forward + backward (many small torch ops);

medians, 2 threads, and the 1-minute load average (the machine is shared: FACTS.md).

    .venv/bin/python benchmarks/bench_kernel_openmp.py                  # 3 rounds
    .venv/bin/python benchmarks/bench_kernel_openmp.py --rounds 1 --schedule dynamic
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"libgomp default": {}, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"}}


def measure(schedule: str) -> list[float]:
    """One process's row (run with the setting already in the environment)."""
    import torch

    import superoffload.kernels as K
    from superoffload.kernels.bench import transformer_sizes
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
            statistics.median(gaps) * 1e6, statistics.median(fb[5:]) * 1e3, os.getloadavg()[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedule", choices=["static", "dynamic"], default="static")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(" ".join(f"{x:.6g}" for x in measure(args.schedule)))
        return
    print(f"schedule={args.schedule}\n\n| setting | ours 26 M, ms | torch fused 26 M, ms | "
          "ours 64 Ki, us | GPT tiny fwd+bwd, ms | load |\n|---|---:|---:|---:|---:|---:|")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            out = subprocess.run([sys.executable, __file__, "--child", "--schedule", args.schedule],
                                 env={**base, **env}, capture_output=True, text=True, check=True)
            a, b, c, d, load = (float(x) for x in out.stdout.split())
            print(f"| {name} | {a:.1f} | {b:.1f} | {c:,.0f} | {d:.1f} | {load:.1f} |", flush=True)


if __name__ == "__main__":
    main()
