"""The CPU Adam kernel with its data in DRAM, not cache (DESIGN.md §6).

A rate measured on one warm buffer is cache speed (the H200 host: 8.4 G params/s = 235 GB/s,
3.3x its DRAM bandwidth). Here `--gb` of buffers (default 2 GB, far beyond this machine's
300 MB L3) are cycled: each timed pass steps every set once, so every call starts with its
data in DRAM. The engine's variant by default: bf16 gradients in, fp32 master and moments,
the fused bf16 copy out (28 B/param moved, +2 B/param of read-for-ownership of the copy).
The OpenMP schedules (`kernels.ExecOptions`) are compared interleaved round by round in ONE
process, and medians reported (the machine is shared: FACTS.md).

    .venv/bin/python benchmarks/bench_kernel_dram.py                 # 2 GB, 2 threads
    .venv/bin/python benchmarks/bench_kernel_dram.py --gb 1 --rounds 7 --variant fp32
    .venv/bin/python benchmarks/bench_kernel_dram.py --layout gpt --rounds 31   # 184 tensors
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import superoffload.kernels as K

BYTES = {"mixed": 28, "fp32": 28, "bf16-moments": 20}


def make_sets(variant: str, set_numel: int, sets: int) -> list[K.PreparedAdam]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(sets):
        p = torch.randn(set_numel, generator=gen) * 0.02
        g32 = torch.randn(set_numel, generator=gen) * 1e-3
        g = g32 if variant == "fp32" else g32.to(torch.bfloat16)
        mdt = torch.bfloat16 if variant == "bf16-moments" else torch.float32
        m = torch.zeros(set_numel, dtype=mdt)
        v = torch.full((set_numel,), 1e-6, dtype=mdt)
        lp = None if variant == "fp32" else [torch.empty(set_numel, dtype=torch.bfloat16)]
        out.append(K.prepare_adam([p], [g], [m], [v], params_lp=lp))
    return out


def make_gpt(numel: int, layers: int) -> list[K.PreparedAdam]:
    """One fp32 call over GPT-like tensors (the CPUAdam benchmark's layout)."""
    from superoffload.kernels.adam_bench import transformer_sizes

    sizes = transformer_sizes(numel, layers=layers)
    ps = [torch.randn(n) * 0.02 for n in sizes]
    gs = [torch.randn(n) * 1e-3 for n in sizes]
    ms, vs = [torch.zeros(n) for n in sizes], [torch.full((n,), 1e-6) for n in sizes]
    return [K.prepare_adam(ps, gs, ms, vs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="bytes of buffers cycled (GB)")
    ap.add_argument("--set-mb", type=float, default=128.0, help="bytes per kernel call (MB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variant", choices=sorted(BYTES), default="mixed")
    ap.add_argument("--layout", choices=["sets", "gpt"], default="sets",
                    help="sets: --gb of buffers cycled; gpt: ONE fp32 call over --numel params "
                         "in 12 tensors per --layers (the CPUAdam benchmark's layout)")
    ap.add_argument("--numel", type=int, default=26_000_000)
    ap.add_argument("--layers", type=int, default=15)
    args = ap.parse_args()
    per_param = {"mixed": 16, "fp32": 16, "bf16-moments": 12}[args.variant]  # resident bytes
    if args.layout == "gpt":
        args.variant, per_param = "fp32", 16
        preps = make_gpt(args.numel, args.layers)
        sets, set_numel = 1, preps[0].numel
    else:
        set_numel = int(args.set_mb * 2**20 / per_param) // 64 * 64
        sets = max(1, int(args.gb * 2**30 / (set_numel * per_param)))
        preps = make_sets(args.variant, set_numel, sets)
    hyper = K.AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    options = {
        "static": K.ExecOptions(schedule="static"),
        "dynamic, 64 Ki-element chunks": K.ExecOptions(schedule="dynamic", chunk_elems=2**16),
        "dynamic, 256 Ki-element chunks": K.ExecOptions(schedule="dynamic", chunk_elems=2**18),
        "dynamic, 1 Mi-element chunks": K.ExecOptions(schedule="dynamic", chunk_elems=2**20),
    }
    times: dict[str, list[float]] = {name: [] for name in options}
    print(f"[bench] {args.variant}: {sets} sets x {set_numel:,} params = "
          f"{sets * set_numel * per_param / 2**30:.2f} GiB resident, threads={args.threads}, "
          f"simd={K.simd_path()}", flush=True)
    for rnd in range(args.rounds + 1):  # round 0 warms up (page faults)
        for name, opt in options.items():
            t0 = time.perf_counter()
            for k, prep in enumerate(preps):
                prep.step(hyper, step=rnd + 1, threads=args.threads, sr_seed=k, options=opt)
            if rnd:
                times[name].append(time.perf_counter() - t0)
    numel = sets * set_numel
    base = statistics.median(times["static"])
    print(f"\n| options | M params/s | GB/s (at {BYTES[args.variant]} B/param) | vs static |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        gbps = numel * BYTES[args.variant] / med / 1e9
        print(f"| {name} | {numel / med / 1e6:,.0f} | {gbps:.1f} | {base / med:.3f}x |")


if __name__ == "__main__":
    main()
