"""CPU Adam benchmark (docs/kernel.md, "Benchmark"): our kernel vs torch AdamW (for-loop,
foreach, fused), DeepSpeed's CPUAdam when importable, and a bandwidth-floor probe, interleaved
in one run.

    .venv/bin/python benchmarks/bench_cpu_adam.py                  # 2^26 params, 2 threads
    .venv/bin/python benchmarks/bench_cpu_adam.py --numel 4194304 --repeats 5   # quick

Same as `python -m superoffload bench adam`; the code lives in superoffload.kernels.adam_bench.
"""

from __future__ import annotations

import argparse
import sys

from superoffload.commands.bench import add_adam_options, run_adam

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_adam_options(parser)
    sys.exit(run_adam(parser.parse_args()))
