"""Weight-stationary vs weight-flow: iteration time against sequence length (paper §4.5).

    # the run in the docs
    .venv/bin/python benchmarks/bench_weightflow.py --seqs 1 4 16 64 128 256 512 1024 --iters 7
    .venv/bin/python benchmarks/bench_weightflow.py --seqs 32 128 --iters 3   # quick look

One GPT (``superoffload.models.gpt``) is trained under each policy at each sequence length,
the two engines alternating iteration by iteration so machine noise hits both; every bucket
is stepped on the host under both (ratio 1, host-side weight casting, speculation off so the
CPU steps run inside ``step()``), so the only difference in forward + backward is whether
block weights stay resident or stream in per block. Reported (best of N iterations: noise on
a shared host only adds time): iteration ms, forward + backward ms, the measured weight-flow
efficiency ``fwd_bwd(stationary) / fwd_bwd(flow)`` and the planner's predicted one,
``compute / (compute + exposed fetch)`` (plan/cost.py), for the same shape -- with the
profile's compute and link rates replaced by the ones measured in this run (forward +
backward FLOP/s of the stationary runs, bytes/s of the ``weight_fetch`` spans).

Crossover: the shortest sequence from which the efficiency stays >= 0.98 (the threshold
``weights="auto"`` uses), measured and predicted.

On a CPU-only host the "device" is the CPU and a fetch is a memcpy on the fetch thread: it
competes with compute for cores and memory bandwidth instead of using a DMA engine, and the
per-block hook and hand-off overheads are Python's. The crossover here says where those
costs vanish into compute on this machine, not what a GPU link would do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

import superoffload as so
from superoffload import plan
from superoffload.config import WeightPolicy
from superoffload.models.gpt import GPT, GPTConfig
from superoffload.plan import cost

POLICIES: tuple[WeightPolicy, ...] = ("stationary", "flow")
THRESHOLD = 0.98
"""Weight-flow counts as free from an efficiency of 0.98 (plan/weights.py)."""


def _serial_efficiency(shape: plan.ModelShape, prof: plan.HardwareProfile,
                       args: argparse.Namespace) -> float:
    """compute / (compute + every fetch), i.e. no overlap at all: what a host whose "link" is
    a memcpy on the same cores would see at worst. Fetches per iteration as the runtime does
    them: every block in forward, all but the last depth + 1 again in backward."""
    compute = sum(cost.compute_time_s(f, prof) for f in shape.layer_forward_flops()) + sum(
        cost.compute_time_s(f, prof) for f in shape.layer_backward_flops())
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    one = cost.link_time_s(itemsize * shape.block_params, prof, "h2d")
    fetches = shape.layers + max(0, shape.layers - args.depth - 1)
    return compute / (compute + fetches * one)


def _crossover(seqs: list[int], effs: list[float]) -> int | None:
    """The shortest sequence from which every longer one reaches THRESHOLD."""
    best = None
    for seq, eff in reversed(list(zip(seqs, effs))):
        if eff < THRESHOLD:
            break
        best = seq
    return best


def _model(args: argparse.Namespace, seq: int) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                    block_size=max(seq, 8), checkpointing=args.checkpointing)
    return GPT(cfg.validate()).to(getattr(torch, args.dtype))


def run_pair(args: argparse.Namespace, seq: int) -> dict[str, dict[str, Any]]:
    """Both policies on identical models, alternating iteration by iteration."""
    g = torch.Generator().manual_seed(seq)
    x = torch.randint(0, 256, (args.batch, seq), generator=g)
    y = torch.roll(x, -1, 1)
    models, engines = {}, {}
    for weights in POLICIES:
        models[weights] = _model(args, seq)
        # speculation off: the CPU steps run in step(), so the timed forward + backward holds
        # only compute and what the weight policy adds (fetches, hooks, waits)
        config = so.OffloadConfig(device="cpu", weights=weights, ratio=1.0, param_cast="host",
                                  bucket_bytes=args.bucket_bytes, prefetch_depth=args.depth,
                                  cpu_threads=1, speculation="off")
        engines[weights] = so.initialize(models[weights], {"lr": 1e-4}, config)
    iter_s: dict[str, list[float]] = {w: [] for w in POLICIES}
    fb_s: dict[str, list[float]] = {w: [] for w in POLICIES}
    try:
        for i in range(args.warmup + args.iters):
            for weights in POLICIES:
                model, engine = models[weights], engines[weights]
                t0 = time.perf_counter()
                engine.backward(model(x, y))
                t1 = time.perf_counter()
                engine.step()
                engine.zero_grad()
                engine.synchronize()
                if i >= args.warmup:
                    iter_s[weights].append(time.perf_counter() - t0)
                    fb_s[weights].append(t1 - t0)
        fetch = [s for s in engines["flow"].telemetry.spans() if s.kind == "weight_fetch"]
    finally:
        for engine in engines.values():
            engine.close()
    shape = plan.ModelShape.from_module(models["stationary"], seq=seq, micro_batch=args.batch,
                                        activation_checkpointing=args.checkpointing)
    # best of N: noise on a shared host only adds time
    return {w: {"seq": seq, "iteration_s": min(iter_s[w]), "fwd_bwd_s": min(fb_s[w]),
                "executed_flops": shape.executed_flops, "shape": shape,
                "fetch_bytes": sum(s.nbytes for s in fetch),
                "fetch_s": sum(s.duration_s for s in fetch)} for w in POLICIES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--depth", type=int, default=1, help="prefetch_depth")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for compute")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows: list[dict[str, Any]] = []
    for seq in args.seqs:
        rows.append(run_pair(args, seq))

    # in-situ rates: compute from the stationary runs, the link from the flow runs' fetches
    flops_s = max(r["stationary"]["executed_flops"] / r["stationary"]["fwd_bwd_s"] for r in rows)
    fetch_b = sum(r["flow"]["fetch_bytes"] for r in rows)
    fetch_s = sum(r["flow"]["fetch_s"] for r in rows)
    link_gbps = fetch_b / fetch_s / 1e9 if fetch_s > 0 else float("inf")
    prof = plan.profiles.get("cpu-laptop").replace(
        name="this-host-in-situ", device_achieved_tflops=flops_s / 1e12,
        device_peak_tflops=max(flops_s / 1e12, 1e-6), h2d_gbps=link_gbps, d2h_gbps=link_gbps,
        link_latency_s=0.0, h2d_table=(), d2h_table=())

    table = []
    for r in rows:
        s, f = r["stationary"], r["flow"]
        table.append({
            "seq": s["seq"], "stationary_s": s["iteration_s"], "flow_s": f["iteration_s"],
            "stationary_fwd_bwd_s": s["fwd_bwd_s"], "flow_fwd_bwd_s": f["fwd_bwd_s"],
            "measured_efficiency": s["fwd_bwd_s"] / f["fwd_bwd_s"],
            "predicted_efficiency": cost.weight_flow_efficiency(s["shape"], prof),
            "predicted_serial_efficiency": _serial_efficiency(s["shape"], prof, args)})
    seqs = [t["seq"] for t in table]
    measured = _crossover(seqs, [t["measured_efficiency"] for t in table])
    predicted = _crossover(seqs, [t["predicted_efficiency"] for t in table])
    serial = _crossover(seqs, [t["predicted_serial_efficiency"] for t in table])
    if args.json:
        print(json.dumps({"rows": table, "measured_crossover_seq": measured,
                          "predicted_crossover_seq": predicted, "serial_crossover_seq": serial,
                          "compute_tflops": flops_s / 1e12,
                          "fetch_gbps": link_gbps}, indent=2))
        return 0
    n_params = rows[0]["stationary"]["shape"].params
    print(f"GPT {args.layers} x {args.width} ({n_params / 1e6:.2f} M params, {args.dtype}), "
          f"batch {args.batch}, prefetch_depth {args.depth}, {args.threads} compute thread(s); "
          f"best of {args.iters} iterations")
    print(f"in-situ rates: compute {flops_s / 1e9:.1f} GFLOP/s, fetch {link_gbps:.2f} GB/s\n")
    print("| seq | stationary ms/iter | flow ms/iter | stationary fwd+bwd ms | flow fwd+bwd ms "
          "| measured efficiency | predicted efficiency | predicted, serial fetch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(f"| {t['seq']} | {t['stationary_s'] * 1e3:.1f} | {t['flow_s'] * 1e3:.1f} | "
              f"{t['stationary_fwd_bwd_s'] * 1e3:.1f} | {t['flow_fwd_bwd_s'] * 1e3:.1f} | "
              f"{t['measured_efficiency']:.3f} | {t['predicted_efficiency']:.3f} | "
              f"{t['predicted_serial_efficiency']:.3f} |")
    print(f"\ncrossover (efficiency >= {THRESHOLD} from this sequence length on): measured seq "
          f"{measured}; predicted seq {predicted} (planner, fetch overlapped), seq {serial} "
          "(serial fetch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
