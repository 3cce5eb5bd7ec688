"""Engine benchmark: iteration time of one model on one machine under three schedules.

  (a) plain   -- no offload: torch.optim.AdamW(fused=True) on the device
  (b) zero    -- a ZeRO-Offload-style schedule through our engine: every bucket on the CPU
                 (ratio=1), no speculation (the CPU steps only after backward's validation),
                 casting on the host (ZeRO-Offload moves 16-bit gradients and weights)
  (c) super   -- the engine with its preset settings (tiny_cpu on a CPU host, pcie_host or
                 gh200 on CUDA): GPU tail buckets, speculation-then-validation, chosen casting

The three run interleaved in rounds in one process (the host is shared: between processes
±10% is noise, FACTS.md), on deep copies of one model with the same batches. Reported:
medians of iteration time, tokens/s, ratios, and the exposed optimizer time (engine
telemetry; for (a) the measured optimizer step, which is exposed by construction).

    python benchmarks/bench_engine.py                 # CPU: the "device" is the CPU too
    python benchmarks/bench_engine.py --device cuda --model medium --dtype bf16

On a CPU-only host the device and the CPU optimizer share the same cores, so offloading
cannot win there; the CPU run checks the machinery and the overheads, the CUDA run the idea.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import superoffload as so
from superoffload import presets
from superoffload.config import MiB, OffloadConfig
from superoffload.data import BatchSampler, load_tokens
from superoffload.models import GPT, PRESETS
from superoffload.telemetry.metrics import summarize


@dataclass
class Result:
    name: str
    iter_s: list[float]
    exposed_s: list[float]
    extra: dict[str, list[float]]
    """Per-round telemetry medians (engine schedules only)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.iter_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_runner(model: torch.nn.Module, lr: float, device: torch.device,
                  batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], Result]:
    """No offload, the usual mixed precision: fp32 weights and Adam state on the device, a
    low-precision model runs under autocast (so all three schedules keep fp32 masters)."""
    low = next(model.parameters()).dtype
    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    autocast = torch.autocast(device.type, dtype=low, enabled=low != torch.float32)
    res = Result("plain", [], [], {})

    def run(n: int) -> Result:
        for k in range(n):
            x, y = batches[k % len(batches)]
            t0 = time.perf_counter()
            with autocast:
                loss = model(x, y)
            loss.backward()
            _sync(device)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            res.iter_s.append(t2 - t0)
            res.exposed_s.append(t2 - t1)  # nothing overlaps the step: all of it is exposed
        return res

    return run


def _engine_runner(name: str, model: torch.nn.Module, lr: float, config: OffloadConfig,
                   device: torch.device, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   engines: list[Any]) -> Callable[[int], Result]:
    engine = so.initialize(model, optimizer={"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1},
                           config=config)
    engines.append(engine)
    res = Result(name, [], [], {})

    def run(n: int) -> Result:
        # iteration time = time between consecutive returns of step(): what a training loop
        # sees, with the CPU tail of one iteration allowed to overlap the next forward
        seq = engine.telemetry.last_seq
        _sync(device)
        last = time.perf_counter()
        for k in range(n):
            x, y = batches[k % len(batches)]
            loss = model(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            float(loss.detach())  # a host sync point, as in any loop that logs its loss
            now = time.perf_counter()
            res.iter_s.append(now - last)
            last = now
        engine.synchronize()
        spans, _ = engine.telemetry.spans_since(seq)
        s = summarize(spans)
        res.exposed_s.append(s.exposed_optimizer_s)
        for key in ("device_idle_frac", "cpu_overlap_frac"):
            res.extra.setdefault(key, []).append(getattr(s, key))
        return res

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", choices=tuple(PRESETS), default=None,
                    help="GPT size (default: small on CPU, medium on CUDA)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="model dtype (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant")
    ap.add_argument("--preset", choices=tuple(presets.PRESETS), default=None,
                    help="settings of (c) (default: tiny_cpu on CPU, pcie_host on CUDA)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket size of (b) and (c)")
    ap.add_argument("--ratio", type=float, default=None, help="ratio of (c)")
    ap.add_argument("--max-grad-norm", type=float, default=0.0,
                    help="clipping for (b) and (c); 0 (default) disables it, so (a) is comparable")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    preset = args.model or ("medium" if cuda else "small")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if cuda else "fp32")]
    batch, seq = args.batch or (16 if cuda else 8), args.seq or (256 if cuda else 128)
    torch.manual_seed(0)
    base = GPT(PRESETS[preset](block_size=max(seq, 64))).to(device=device, dtype=dtype)
    sampler = BatchSampler(load_tokens(), batch_size=batch, seq_len=seq, seed=0, device=device)
    batches = [sampler.next_batch() for _ in range(8)]
    super_cfg = presets.PRESETS[args.preset or ("pcie_host" if cuda else "tiny_cpu")]()
    changes: dict[str, Any] = {"device": str(device), "max_grad_norm": args.max_grad_norm or None}
    if not cuda:
        changes["pin_memory"] = False
    if args.bucket_mb:
        changes["bucket_bytes"] = int(args.bucket_mb * MiB)
    super_cfg = super_cfg.replace(**changes)
    if args.ratio is not None:
        super_cfg = super_cfg.replace(ratio=args.ratio)
    zero_cfg = super_cfg.replace(ratio=1.0, speculation="off", grad_cast="host", param_cast="host")

    engines: list[Any] = []
    lr = 1e-4
    runners = {
        "plain": _plain_runner(copy.deepcopy(base), lr, device, batches),
        "zero": _engine_runner("zero", copy.deepcopy(base), lr, zero_cfg, device, batches, engines),
        "super": _engine_runner("super", copy.deepcopy(base), lr, super_cfg, device, batches, engines),
    }
    results: dict[str, Result] = {}
    try:
        for name, run in runners.items():  # warm-up: allocations, first touch, thread start
            results[name] = run(args.warmup)
            results[name].iter_s.clear()
            results[name].exposed_s.clear()
            results[name].extra.clear()
        for _ in range(args.rounds):
            for run in runners.values():
                run(args.iters)
    finally:
        for e in engines:
            e.close()

    tokens = batch * seq
    n_params = sum(p.numel() for p in base.parameters())
    plain, zero = results["plain"].median_s, results["zero"].median_s
    rows = []
    for name, r in results.items():
        rows.append({
            "schedule": name, "iter_ms": r.median_s * 1e3, "tokens_per_s": tokens / r.median_s,
            "vs_plain": plain / r.median_s, "vs_zero": zero / r.median_s,
            "exposed_optimizer_ms": statistics.median(r.exposed_s) * 1e3,
            **{k: statistics.median(v) for k, v in r.extra.items() if v},
        })
    host = f"{torch.get_num_threads()} torch threads"
    meta = {"device": str(device) if not cuda else torch.cuda.get_device_name(device),
            "host": host, "model": preset, "params": n_params, "dtype": str(dtype).split(".")[-1],
            "batch": batch, "seq": seq, "iters": args.iters * args.rounds,
            "super_config": {k: getattr(super_cfg, k) for k in
                             ("bucket_bytes", "ratio", "speculation", "grad_cast", "param_cast",
                              "cpu_threads")}}
    print(f"{meta['model']} GPT, {n_params / 1e6:.2f} M params, {meta['dtype']}, batch {batch} x "
          f"{seq}, on {meta['device']} ({host}); medians of {meta['iters']} iterations")
    print(f"{'schedule':<8} {'iter ms':>9} {'tokens/s':>10} {'vs plain':>9} {'vs zero':>8} "
          f"{'exposed opt ms':>15} {'dev idle':>9} {'overlap':>8}")
    for row in rows:
        idle = f"{row['device_idle_frac']:.0%}" if "device_idle_frac" in row else "-"
        ov = f"{row['cpu_overlap_frac']:.0%}" if "cpu_overlap_frac" in row else "-"
        print(f"{row['schedule']:<8} {row['iter_ms']:>9.1f} {row['tokens_per_s']:>10,.0f} "
              f"{row['vs_plain']:>8.2f}x {row['vs_zero']:>7.2f}x {row['exposed_optimizer_ms']:>15.1f} "
              f"{idle:>9} {ov:>8}")
    out = {"meta": meta, "rows": rows}
    if args.json:
        print(json.dumps(out))
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
