"""Per-call overhead of the CPU Adam paths on many tensors (docs/kernel.md, "Per-call overhead").

`so.CPUAdam.step()` vs `torch.optim.AdamW(fused=True).step()` vs the raw kernel
(`kernels.adam_step_multi`, which validates everything on every call) vs a prepared call
(`kernels.prepare_adam(...).step`, validated once). All methods step the SAME tensors (the
torch optimizer and CPUAdam get their state pre-filled with the shared moments), so memory
placement is identical, and they run interleaved round by round in one process (the
machine is shared: separate runs differ by +-10%, FACTS.md); medians are reported.

    .venv/bin/python benchmarks/bench_cpu_adam_overhead.py   # 26 M params, 184 tensors
    .venv/bin/python benchmarks/bench_cpu_adam_overhead.py --numel 4000000 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import superoffload as so
import superoffload.kernels as K
from superoffload.kernels.adam_bench import transformer_sizes

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def build(numel: int, layers: int, threads: int) -> dict[str, Callable[[], None]]:
    sizes = transformer_sizes(numel, layers=layers)
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
    ms = [torch.zeros(n) for n in sizes]
    vs = [torch.full((n,), 1e-6) for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.numel(), generator=gen) * 1e-3
    gs = [p.grad for p in ps]

    fused = torch.optim.AdamW(ps, fused=True, **HP)  # type: ignore[arg-type]
    ours = so.CPUAdam(ps, threads=threads, **HP)  # type: ignore[arg-type]
    for p, m, v in zip(ps, ms, vs):
        fused.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
        ours.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
    hyper = K.AdamHyper.from_group(ours.param_groups[0])
    prepared = K.prepare_adam(ps, gs, ms, vs)
    step = [2]

    def raw() -> None:
        K.adam_step_multi(ps, gs, ms, vs, step=step[0], lr=hyper.lr, beta1=hyper.beta1,
                          beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                          threads=threads)

    def prep() -> None:
        prepared.step(hyper, step=step[0], threads=threads)

    def prep_grads() -> None:  # new grad list each call, as CPUAdam after zero_grad(None)
        prepared.step(hyper, step=step[0], threads=threads, grads=list(gs))

    print(f"[bench] {len(sizes)} tensors, {sum(sizes):,} params, threads={threads}, "
          f"simd={K.simd_path()}", flush=True)
    return {"torch AdamW(fused=True).step()": fused.step, "so.CPUAdam.step()": ours.step,
            "kernels.adam_step_multi": raw, "PreparedAdam.step": prep,
            "PreparedAdam.step(grads=...)": prep_grads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=26_000_000)
    ap.add_argument("--layers", type=int, default=15, help="GPT-like layers (12 tensors each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = build(args.numel, args.layers, args.threads)
    times: dict[str, list[float]] = {name: [] for name in methods}
    with torch.no_grad():
        for rnd in range(args.repeats + 1):  # round 0 warms up
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch AdamW(fused=True).step()"])
    print("\n| method | median ms | vs torch fused (time ratio, >1 = faster) |\n|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {base / med:.3f}x |")


if __name__ == "__main__":
    main()
