"""The offload engine over FSDP2 (``FsdpOffloadEngine``) against its peers, one run, 2 ranks:
``bench_fsdp.py --engine`` runs this (docs/distributed.md, "FSDP2 under the engine").

Arms (each its own copy of the model, the same initial weights and data):

* ``fsdp_engine``: ``FsdpOffloadEngine`` (the engine's transport over FSDP2: FSDP2
  reduce-scatters and all-gathers, the engine offloads, speculates and steps on the CPU);
* ``fsdp_cpu_adam``: plain FSDP2 with ``CPUOffloadPolicy`` and ``so.CPUAdam`` (no engine: the
  step waits for the whole backward, nothing overlaps).

The former ZeRO transport ran here as a third arm until it was removed; the table measured
against it is in docs/distributed.md ("Benchmark").

A round runs ``--block`` iterations per arm (forward, backward, step, zero_grad; the engine's
CPU step overlaps the next forward inside a block), then waits for every in-flight update
(``engine.synchronize()``), in a rotating order of the arms, so drifting load hits all alike;
the time per iteration is the block's wall time over ``--block``, rank 0's clock after a
barrier; medians over the rounds after ``--warmup``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model(preset: str) -> torch.nn.Module:
    from superoffload.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    return GPT(PRESETS[preset]())


def _config(threads: int) -> Any:
    from superoffload.config import OffloadConfig

    return OffloadConfig(device="cpu", cpu_threads=threads, max_grad_norm=1.0,
                         telemetry=False, watchdog_s=600.0)


class _Plain:
    """FSDP2 + CPUOffloadPolicy + so.CPUAdam behind the engine's three calls."""

    def __init__(self, model: torch.nn.Module, threads: int) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        import superoffload as so

        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        self.opt = so.CPUAdam(model.parameters(), threads=threads, **HYPER)
        self.model = model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        return None


def build_arms(preset: str, threads: int) -> dict[str, tuple[torch.nn.Module, Any]]:
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    arms: dict[str, tuple[torch.nn.Module, Any]] = {}
    model = _model(preset)
    arms["fsdp_engine"] = (model, FsdpOffloadEngine(model, dict(HYPER), _config(threads)))
    model = _model(preset)
    arms["fsdp_cpu_adam"] = (model, _Plain(model, threads))
    return arms


def run_engines(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from superoffload.kernels.bench import rotated
    from superoffload.models.gpt import PRESETS

    cfg = PRESETS[args.preset]()
    arms = build_arms(args.preset, args.threads)
    g = torch.Generator().manual_seed(1 + rank)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.warmup + args.rounds):
        batches = [(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
                    torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g))
                   for _ in range(args.block)]
        for name in rotated(list(arms), r):
            model, engine = arms[name]
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in batches:
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) / args.block)
    for _, engine in arms.values():
        if hasattr(engine, "close"):
            engine.close()
    params = sum(p.numel() for p in _model(args.preset).parameters())
    return {"rank": rank, "world": world, "preset": args.preset, "params": params,
            "seq": args.seq, "batch": args.batch, "rounds": args.rounds, "block": args.block,
            "threads": args.threads, "torch": torch.__version__,
            "median_s": {n: statistics.median(t) for n, t in times.items()},
            "all_s": times}


def engine_table(res: dict[str, Any]) -> str:
    med = res["median_s"]
    base = med["fsdp_cpu_adam"]
    rows = ["| arm | iteration ms (median) | vs fsdp_cpu_adam |", "|---|---|---|"]
    for name, s in med.items():
        rows.append(f"| {name} | {s * 1e3:.1f} | {s / base:.2f}x |")
    head = (f"{res['preset']}: {res['params'] / 1e6:.2f} M parameters, {res['world']} ranks, "
            f"batch {res['batch']} x {res['seq']} tokens per rank, {res['rounds']} rounds of "
            f"{res['block']} iterations per arm, {res['threads']} thread(s) per rank, torch "
            f"{res['torch']}")
    return head + "\n\n" + "\n".join(rows)
