"""FSDP2 + CPUOffloadPolicy: the optimizer step and the iteration with three CPU optimizers
(docs/distributed.md, "FSDP2 with so.CPUAdam"): torch.optim.AdamW's default on CPU DTensors
(the single-tensor for-loop), AdamW(fused=True), and so.CPUAdam, interleaved round by round in
one run.

    flock /tmp/so-bench.lock .venv/bin/python benchmarks/bench_fsdp.py             # 2 ranks
    .venv/bin/python benchmarks/bench_fsdp.py --preset small --rounds 5            # quick
    .venv/bin/python benchmarks/bench_fsdp.py --engine --preset tiny              # the engine

``--engine``: the offload engine over FSDP2 against plain FSDP2 + so.CPUAdam, with the
planner's predicted iteration beside the engine's measured one (benchmarks/bench_fsdp_engine.py).

Without torchrun's variables the script starts itself under ``torch.distributed.run`` with
``--ranks`` processes (gloo on the CPU). Each rank builds the same GPT (superoffload.models),
shards every block and the root with ``fully_shard(offload_policy=CPUOffloadPolicy())``
(pinned memory only when CUDA exists), and keeps one copy of the model per optimizer (same
initial weights). Each round runs one iteration (forward, backward, step, zero_grad) per
optimizer, in a rotating order, so drifting machine load hits all three alike. Times are
medians over the rounds after ``--warmup``, of rank 0's wall clock; the step is
``opt.step()`` alone, the iteration includes it. One intra-op thread and one CPUAdam thread
per rank (``--threads``): 2 ranks share the 2 cores of the CI machine. Prints a markdown
table; ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

OPTIMIZERS = ("adamw_default", "adamw_fused", "so_cpu_adam")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes when not under torchrun")
    p.add_argument("--preset", default="medium", choices=("tiny", "small", "medium", "gpt2"),
                   help="superoffload.models preset (medium: ~25 M parameters)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch and CPUAdam threads per rank")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--engine", action="store_true",
                   help="time the offload engine over FSDP2 against its peers instead")
    p.add_argument("--block", type=int, default=3,
                   help="--engine: iterations per arm and round (the overlap spans them)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="--engine: OffloadConfig.bucket_bytes (default: its default; smaller "
                        "buckets make several FSDP2 units of a small model)")
    p.add_argument("--profile", default="local",
                   help="--engine: the planner's profile for the predicted column: 'local' "
                        "(measured here, cached), a preset, a profile JSON, or 'none'")
    return p.parse_args(argv)


def relaunch(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(args.ranks), __file__, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    return subprocess.call(cmd, env=env, timeout=3600)


def build(preset: str, seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from superoffload.models import GPT
    from superoffload.models.gpt import PRESETS

    torch.manual_seed(seed)
    model = GPT(PRESETS[preset]())
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in model.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def make_optimizer(name: str, model: torch.nn.Module, threads: int) -> torch.optim.Optimizer:
    import superoffload as so

    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if name == "adamw_default":
        return torch.optim.AdamW(model.parameters(), **hyper)  # CPU DTensors: the for-loop
    if name == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    return so.CPUAdam(model.parameters(), threads=threads, **hyper)


def iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
              y: torch.Tensor) -> tuple[float, float]:
    """(step seconds, iteration seconds); a barrier first so every rank starts together."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    model(x, y).backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    return t2 - t1, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from superoffload.kernels.adam_bench import rotated
    from superoffload.models.gpt import PRESETS

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    models = {name: build(args.preset, seed=0) for name in OPTIMIZERS}
    opts = {name: make_optimizer(name, models[name], args.threads) for name in OPTIMIZERS}
    cfg = PRESETS[args.preset]()
    g = torch.Generator().manual_seed(1 + rank)
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "iter": []} for n in OPTIMIZERS}
    for r in range(args.warmup + args.rounds):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        for name in rotated(list(OPTIMIZERS), r):  # rotate who goes first
            step_s, iter_s = iteration(models[name], opts[name], x, y)
            if r >= args.warmup:
                times[name]["step"].append(step_s)
                times[name]["iter"].append(iter_s)
    # the three copies started equal and saw the same data: their weights must agree
    ref = [p.detach().full_tensor() for p in models["adamw_fused"].parameters()]
    drift = max(float((p.detach().full_tensor() - q).abs().max())
                for name in OPTIMIZERS for p, q in zip(models[name].parameters(), ref))
    numel = sum(p.numel() for p in models["so_cpu_adam"].parameters())
    local = sum(p.to_local().numel() for p in models["so_cpu_adam"].parameters())
    dist.destroy_process_group()
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    return {"rank": rank, "world": world, "preset": args.preset, "params": numel,
            "local_params_rank0": local, "seq": args.seq, "batch": args.batch,
            "rounds": args.rounds, "threads": args.threads, "median_s": med,
            "max_weight_diff_vs_fused": drift, "torch": torch.__version__}


def table(res: dict[str, Any]) -> str:
    base = res["median_s"]["adamw_default"]
    rows = ["| optimizer | step ms (median) | step speed-up vs default | iteration ms (median) "
            "| iteration speed-up vs default |", "|---|---|---|---|---|"]
    for name in OPTIMIZERS:
        m = res["median_s"][name]
        rows.append(f"| {name} | {m['step'] * 1e3:.1f} | {base['step'] / m['step']:.2f}x | "
                    f"{m['iter'] * 1e3:.1f} | {base['iter'] / m['iter']:.2f}x |")
    head = (f"{res['preset']}: {res['params'] / 1e6:.1f} M parameters "
            f"({res['local_params_rank0'] / 1e6:.2f} M on rank 0), {res['world']} ranks, "
            f"batch {res['batch']} x {res['seq']} tokens per rank, {res['rounds']} rounds, "
            f"{res['threads']} thread(s) per rank, torch {res['torch']}; "
            "max |weight diff| vs fused after the run: "
            f"{res['max_weight_diff_vs_fused']:.1e}")
    return head + "\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        return relaunch(args)
    if args.engine:
        import torch.distributed as dist

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_fsdp_engine import engine_table, run_engines

        from superoffload.distributed import init_distributed, shutdown

        torch.set_num_threads(args.threads)
        info = init_distributed(backend="gloo", timeout_s=600)
        res = run_engines(args, info.rank, info.world_size)
        dist.barrier()
        shutdown()
        render = engine_table
    else:
        res = run(args)
        render = table
    if res["rank"] == 0:
        print(render(res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
