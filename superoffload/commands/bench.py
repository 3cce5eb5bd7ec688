"""`python -m superoffload bench adam`: the CPU Adam benchmark (superoffload.kernels.bench).

Options keep a quick run possible: `--numel 4194304 --repeats 5`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (adam: the CPU Adam kernel vs its peers)")
    p.add_argument("what", choices=["adam"], help="what to benchmark")
    add_adam_options(p)
    p.set_defaults(func=_run)


def add_adam_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=2**26,
                   help="fp32 parameters per layout (default 2^26 = 67,108,864)")
    p.add_argument("--threads", type=int, default=2, help="threads for every method (default 2)")
    p.add_argument("--repeats", type=int, default=15,
                   help="interleaved rounds; medians are reported (default 15)")
    p.add_argument("--layout", choices=["flat", "195", "both"], default="both",
                   help="one flat tensor, ~195 transformer-like tensors, or both")
    p.add_argument("--no-deepspeed", action="store_true",
                   help="skip DeepSpeed's CPUAdam even when deepspeed is importable")


def run_adam(args: argparse.Namespace) -> int:
    from superoffload.kernels import bench

    layouts = ("flat", "195") if args.layout == "both" else (args.layout,)
    bench.main(numel=args.numel, threads=args.threads, repeats=args.repeats, layouts=layouts,
               with_deepspeed=not args.no_deepspeed)
    return 0


def _run(args: argparse.Namespace) -> int:
    return run_adam(args)
