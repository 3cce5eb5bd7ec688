"""`python -m superoffload bench adam`: the CPU Adam benchmark (superoffload.kernels.adam_bench).

Options keep a quick run possible: `--numel 4194304 --repeats 5`. Each is checked where it
is parsed (`argtypes.positive_int`): 0 or a negative count is one argparse error line."""

from __future__ import annotations

import argparse

from superoffload.commands.argtypes import positive_int


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (adam: the CPU Adam kernel vs its peers)",
                       usage="python -m superoffload bench adam [options]   (--help lists them)")
    p.add_argument("what", choices=["adam"], help="what to benchmark")
    add_adam_options(p)
    p.set_defaults(func=_run)


def add_adam_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=positive_int, default=2**26,
                   help="fp32 parameters per layout (default 2^26 = 67,108,864)")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="threads for every method (default 2)")
    p.add_argument("--repeats", type=positive_int, default=15,
                   help="interleaved rounds, the method order rotated each round; medians "
                        "are reported (default 15)")
    p.add_argument("--layout", choices=["flat", "195", "both"], default="both",
                   help="one flat tensor, ~195 transformer-like tensors, or both")
    p.add_argument("--no-deepspeed", action="store_true",
                   help="skip DeepSpeed's DeepSpeedCPUAdam even when deepspeed is importable "
                        "(pip install 'superoffload[deepspeed]'; its op is JIT-built once)")


def run_adam(args: argparse.Namespace) -> int:
    from superoffload.kernels import adam_bench

    layouts = ("flat", "195") if args.layout == "both" else (args.layout,)
    adam_bench.run_benchmark(numel=args.numel, threads=args.threads, repeats=args.repeats,
                             layouts=layouts, with_deepspeed=not args.no_deepspeed)
    return 0


def _run(args: argparse.Namespace) -> int:
    return run_adam(args)
