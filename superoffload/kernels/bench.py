"""CPU Adam benchmark: our kernel vs torch AdamW (for-loop, foreach, fused) vs DeepSpeed.

ONE process, methods interleaved round by round (the machine is shared: separate runs
differ by ±10%, FACTS.md), medians of `repeats` steps, on `numel` fp32 parameters laid out
as one flat tensor and as ~200 tensors of transformer-like sizes. The floor is measured,
not assumed: a probe with the step's exact memory traffic (read p, g, m, v; write p, m, v
in place, 28 B/param) in the same parallel region (DESIGN.md §4).

    python -m superoffload bench adam [--numel N] [--threads T] [--repeats R]
    python benchmarks/bench_cpu_adam.py ...same options...
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import superoffload.kernels as K

# bytes moved per parameter by each method (reads + writes)
FP32_BYTES = 28  # p, g, m, v read (16) + p, m, v written (12)
MIXED_BYTES = 28  # p 4+4, bf16 g 2, m 4+4, v 4+4, bf16 copy 2
BF16_MOMENT_BYTES = 20  # p 4+4, bf16 g 2, bf16 m 2+2, bf16 v 2+2, bf16 copy 2
SEPARATE_CAST_BYTES = FP32_BYTES + 6  # + read p (4) + write bf16 copy (2)


@dataclass(frozen=True, slots=True)
class Result:
    layout: str
    method: str
    median_s: float
    bytes_per_param: int
    numel: int

    @property
    def params_per_s(self) -> float:
        return self.numel / self.median_s

    @property
    def gbps(self) -> float:
        return self.params_per_s * self.bytes_per_param / 1e9


def transformer_sizes(numel: int, layers: int = 16) -> list[int]:
    """~196 tensor sizes of a GPT-like model summing to `numel` (12 tensors per layer:
    2 LayerNorms, qkv, attention out, 2 MLP weights with biases; embeddings at the end)."""
    d = max(64, int(math.sqrt(numel / (12 * layers + 40))) // 64 * 64)
    per_layer = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    sizes = per_layer * layers + [1024 * d, d, d]
    rest = numel - sum(sizes)
    if rest <= 0:  # tiny numel: fall back to equal chunks
        return [numel // 196 + (1 if i < numel % 196 else 0) for i in range(196)]
    return [*sizes, rest]  # the token embedding takes what is left


class _State:
    """One shared set of tensors per layout; every method steps the same p, g, m, v (torch
    optimizers get their state pre-filled with our m, v) so memory stays ~1.5 GB at 2^26."""

    def __init__(self, sizes: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.p = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes]
        self.g = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
        self.m = [torch.zeros(n) for n in sizes]
        self.v = [torch.full((n,), 1e-6) for n in sizes]
        self.g16 = [g.to(torch.bfloat16) for g in self.g]
        self.lp = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        self.m16 = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
        self.v16 = [torch.full((n,), 1e-6, dtype=torch.bfloat16) for n in sizes]
        for p, g in zip(self.p, self.g):
            p.grad = g
        self.step = 1

    def torch_optimizer(self, **kw) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(self.p, lr=1e-4, weight_decay=0.01, **kw)
        for p, m, v in zip(self.p, self.m, self.v):
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
        return opt


def _deepspeed_step(state: _State) -> Callable[[], None] | None:
    """DeepSpeed's CPUAdam on the same tensors, or None when deepspeed is not importable
    (or its CPU op cannot be JIT-built)."""
    # build DeepSpeed's op once, into the project's git-ignored cache (FACTS.md)
    repo = Path(__file__).resolve().parents[2]
    root = repo if (repo / "pyproject.toml").exists() else Path.cwd()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".cache" / "torch_extensions"))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        opt = DeepSpeedCPUAdam(state.p, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    except Exception as exc:
        print(f"[bench] DeepSpeed CPUAdam unavailable: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    for p, m, v in zip(state.p, state.m, state.v):
        opt.state[p] = {"step": 1, "exp_avg": m, "exp_avg_sq": v}
    return lambda: opt.step()


def _methods(state: _State, threads: int, with_deepspeed: bool
             ) -> list[tuple[str, int, Callable[[], None]]]:
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, threads=threads)

    def ours() -> None:
        K.adam_step_multi(state.p, state.g, state.m, state.v, step=state.step, **hp)

    def ours_mixed() -> None:  # bf16 grads in, fused bf16 copy out
        K.adam_step_multi(state.p, state.g16, state.m, state.v, step=state.step,
                          params_lp=state.lp, **hp)

    def ours_bf16_moments() -> None:
        K.adam_step_multi(state.p, state.g16, state.m16, state.v16, step=state.step,
                          params_lp=state.lp, sr_seed=state.step, **hp)

    loop, foreach = state.torch_optimizer(foreach=False), state.torch_optimizer(foreach=True)
    fused = state.torch_optimizer(fused=True)

    def fused_then_cast() -> None:
        fused.step()
        torch._foreach_copy_(state.lp, [p.detach() for p in state.p])

    methods = [
        ("ours fp32", FP32_BYTES, ours),
        ("torch AdamW() default (for-loop)", FP32_BYTES, lambda: loop.step()),
        ("torch AdamW(foreach=True)", FP32_BYTES, lambda: foreach.step()),
        ("torch AdamW(fused=True)", FP32_BYTES, lambda: fused.step()),
        ("ours bf16 grad + fused bf16 copy", MIXED_BYTES, ours_mixed),
        ("torch fused + separate bf16 copy", SEPARATE_CAST_BYTES, fused_then_cast),
        ("ours bf16 moments (SR) + bf16 grad/copy", BF16_MOMENT_BYTES, ours_bf16_moments),
    ]
    if K.backend() == "cffi":
        from superoffload.kernels.cpu_adam import bandwidth_probe

        methods.append(("floor probe (Adam-shaped traffic)", FP32_BYTES,
                        lambda: bandwidth_probe(state.p, state.g, state.m, state.v,
                                                threads=threads)))
    if with_deepspeed:
        ds = _deepspeed_step(state)
        if ds is not None:
            methods.insert(4, ("DeepSpeed CPUAdam fp32", FP32_BYTES, ds))
    return methods


def run_layout(layout: str, sizes: list[int], threads: int, repeats: int,
               with_deepspeed: bool) -> list[Result]:
    """All methods on one layout, interleaved: round r times each method once."""
    state = _State(sizes)
    methods = _methods(state, threads, with_deepspeed)
    times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    torch.set_num_threads(threads)
    with torch.no_grad():
        for rnd in range(repeats + 1):  # round 0 warms up (page faults, JIT, thread pools)
            for name, _, fn in methods:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rnd > 0:
                    times[name].append(dt)
            state.step += 1
    numel = sum(sizes)
    out = [Result(layout, name, statistics.median(times[name]), nbytes, numel)
           for name, nbytes, _ in methods]
    del state, methods
    gc.collect()
    return out


def format_table(results: list[Result], threads: int) -> str:
    """Markdown table: params/s, ratio to torch fused (and to fused + cast for the mixed
    pass), ratio to DeepSpeed, % of the measured floor (by bytes moved)."""
    lines = [f"threads={threads}, simd={K.simd_path()}, backend={K.backend()}", "",
             "| layout | method | M params/s | vs torch fused | vs DeepSpeed | GB/s | % of floor |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for layout in dict.fromkeys(r.layout for r in results):
        rows = {r.method: r for r in results if r.layout == layout}
        fused = rows["torch AdamW(fused=True)"]
        cast = rows["torch fused + separate bf16 copy"]
        ds = rows.get("DeepSpeed CPUAdam fp32")
        floor = rows.get("floor probe (Adam-shaped traffic)")
        for r in rows.values():
            base = cast if r.method.startswith("ours bf16") else fused
            vs = f"{r.params_per_s / base.params_per_s:.2f}x" + (" (vs fused+copy)" if base is cast else "")
            vs_ds = f"{r.params_per_s / ds.params_per_s:.2f}x" if ds else "n/a"
            pct = f"{100 * r.gbps / floor.gbps:.0f}%" if floor else "n/a"
            lines.append(f"| {layout} | {r.method} | {r.params_per_s / 1e6:,.0f} | {vs} | "
                         f"{vs_ds} | {r.gbps:.1f} | {pct} |")
    return "\n".join(lines)


def main(numel: int = 2**26, threads: int = 2, repeats: int = 15,
         layouts: tuple[str, ...] = ("flat", "195"), with_deepspeed: bool = True) -> str:
    results: list[Result] = []
    for layout in layouts:
        sizes = [numel] if layout == "flat" else transformer_sizes(numel)
        print(f"[bench] {layout}: {len(sizes)} tensors, {sum(sizes):,} params, "
              f"{repeats} interleaved rounds ...", flush=True)
        results += run_layout(f"{layout} ({len(sizes)})", sizes, threads, repeats,
                              with_deepspeed)
    table = format_table(results, threads)
    print(table)
    return table
