"""CPU Adam benchmark: our kernel vs torch AdamW (for-loop, foreach, fused) vs DeepSpeed's
DeepSpeedCPUAdam (when importable), beside the machine's measured memory floor.

ONE process; every round runs every method once, in an order rotated by one each round
(so no method always follows the same neighbour, or always runs first on a warm cache);
medians of `repeats` rounds; ratios taken within the run (the machine may be shared:
separate runs differ by ±10%, FACTS.md). `numel` fp32 parameters, laid out as one flat
tensor and as ~200 tensors of transformer-like sizes, in two cases:

* fp32: parameters, gradients and moments fp32 (28 B/param: read p, g, m, v; write p, m, v);
* bf16 parameters with fp32 masters: bf16 gradients in, the fp32 master stepped, the bf16
  parameter written. Ours does it in one pass (28 B/param); the peers widen the gradients,
  step the masters and copy back (40 B/param), which is what a bf16 model costs them.

The floor is measured, not assumed: a probe with the fp32 step's exact memory traffic
(read p, g, m, v; write p, m, v IN PLACE) in the same parallel region (DESIGN.md §4). A
STREAM triad (a = b + s*c) is printed beside it: it writes a separate array, whose lines
the CPU first reads (write-allocate) without STREAM counting them, so it underestimates
what an in-place optimizer can reach (FACTS.md: fused optimizers at 136-186% of it).

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

FP32, MIXED, FLOOR = "fp32", "bf16 params + fp32 masters", "memory floor"
# bytes moved per parameter by each method (reads + writes)
# p, g, m, v read (16) + p, m, v written (12)
FP32_BYTES = 28
# p 4+4, bf16 g 2, m 4+4, v 4+4, bf16 copy 2
MIXED_BYTES = 28
# p 4+4, bf16 g 2, bf16 m 2+2, bf16 v 2+2, bf16 copy 2
BF16_MOMENT_BYTES = 20
# widen g (2 + 4), the fp32 step, copy back (4 + 2)
PIPELINE_BYTES = 6 + FP32_BYTES + 6
# STREAM's count for a = b + s*c: read b, c, write a (4 each)
TRIAD_BYTES = 12
TORCH_FUSED = {FP32: "torch AdamW(fused=True)", MIXED: "torch fused: widen, step, copy back"}
DEEPSPEED = {FP32: "DeepSpeed CPUAdam", MIXED: "DeepSpeed CPUAdam: widen, step, copy back"}
PROBE = "in-place probe (Adam's 28 B/param)"
TRIAD = "STREAM triad a = b + s*c (12 B counted)"


@dataclass(frozen=True, slots=True)
class Method:
    case: str
    name: str
    bytes_per_param: int
    run: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Result:
    layout: str
    case: str
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
    # tiny numel: fall back to equal chunks
    if rest <= 0:
        # the first numel % 196 chunks take one element more, so they sum to numel
        return [numel // 196 + (i < numel % 196) for i in range(196)]
    # the token embedding takes what is left
    return [*sizes, rest]


def rotated(items: list, round_index: int) -> list:
    """`items` rotated left by `round_index` (the order of one round)."""
    k = round_index % max(1, len(items))
    return items[k:] + items[:k]


class _State:
    """One shared set of tensors per layout; every method steps the same p, g, m, v (torch
    optimizers get their state pre-filled with our m, v) so memory stays ~2 GB at 2^26."""

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
        # copy_back's sources, made once
        self.p_data = [p.detach() for p in self.p]
        # the triad's three arrays: as large as the state, so in DRAM
        total = sum(sizes)
        self.triad = [torch.zeros(total), torch.full((total,), 1e-3), torch.full((total,), 2e-3)]
        self.step = 1

    def torch_optimizer(self, **kw) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(self.p, lr=1e-4, weight_decay=0.01, **kw)
        for p, m, v in zip(self.p, self.m, self.v):
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
        return opt

    def widen_grads(self) -> None:
        """bf16 gradients into the fp32 buffers the peers step from (the values stay those
        of g16 after the first round: the timing does not depend on them)."""
        torch._foreach_copy_(self.g, self.g16)

    def copy_back(self) -> None:
        torch._foreach_copy_(self.lp, self.p_data)


def _deepspeed_optimizer(state: _State) -> torch.optim.Optimizer | None:
    """DeepSpeed's DeepSpeedCPUAdam on the same tensors, or None when deepspeed is not
    importable or its CPU op cannot be JIT-built (the reason is printed)."""
    # build DeepSpeed's op once, into the project's git-ignored cache (FACTS.md)
    repo = Path(__file__).resolve().parents[2]
    root = repo
    # an installed (not editable) package has no checkout around it: cache under the cwd
    if not (repo / "pyproject.toml").exists():
        root = Path.cwd()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".cache" / "torch_extensions"))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        opt = DeepSpeedCPUAdam(state.p, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    except Exception as exc:
        print(f"[bench] DeepSpeed CPUAdam unavailable: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    for p, m, v in zip(state.p, state.m, state.v):
        opt.state[p] = {"step": 1, "exp_avg": m, "exp_avg_sq": v}
    return opt


def _methods(state: _State, threads: int, with_deepspeed: bool) -> list[Method]:
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, threads=threads)

    def ours() -> None:
        K.adam_step_multi(state.p, state.g, state.m, state.v, step=state.step, **hp)

    # bf16 grads in, fp32 master stepped, bf16 parameter out
    def ours_mixed() -> None:
        K.adam_step_multi(state.p, state.g16, state.m, state.v, step=state.step,
                          params_lp=state.lp, **hp)

    def ours_bf16_moments() -> None:
        K.adam_step_multi(state.p, state.g16, state.m16, state.v16, step=state.step,
                          params_lp=state.lp, sr_seed=state.step, **hp)

    def pipeline(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            state.widen_grads()
            opt.step()
            state.copy_back()
        return run

    def triad() -> None:
        a, b, c = state.triad
        torch.add(b, c, alpha=3.0, out=a)

    loop, foreach = state.torch_optimizer(foreach=False), state.torch_optimizer(foreach=True)
    fused = state.torch_optimizer(fused=True)
    methods = [
        Method(FP32, "ours", FP32_BYTES, ours),
        Method(FP32, "torch AdamW() default (for-loop)", FP32_BYTES, lambda: loop.step()),
        Method(FP32, "torch AdamW(foreach=True)", FP32_BYTES, lambda: foreach.step()),
        Method(FP32, TORCH_FUSED[FP32], FP32_BYTES, lambda: fused.step()),
        Method(MIXED, "ours: bf16 grad in, fused bf16 copy out", MIXED_BYTES, ours_mixed),
        Method(MIXED, TORCH_FUSED[MIXED], PIPELINE_BYTES, pipeline(fused)),
        Method(MIXED, "ours + bf16 moments (stochastic rounding)", BF16_MOMENT_BYTES,
               ours_bf16_moments),
        Method(FLOOR, TRIAD, TRIAD_BYTES, triad),
    ]
    if K.backend() == "cffi":
        from superoffload.kernels.cpu_adam import bandwidth_probe

        methods.append(Method(FLOOR, PROBE, FP32_BYTES, lambda: bandwidth_probe(
            state.p, state.g, state.m, state.v, threads=threads)))
    # a DeepSpeed build is minutes on a cold cache: only when the caller asks for the peer
    ds = _deepspeed_optimizer(state) if with_deepspeed else None
    if ds is not None:
        methods.insert(4, Method(FP32, DEEPSPEED[FP32], FP32_BYTES, lambda: ds.step()))
        methods.insert(7, Method(MIXED, DEEPSPEED[MIXED], PIPELINE_BYTES, pipeline(ds)))
    return methods


def run_layout(layout: str, sizes: list[int], threads: int, repeats: int,
               with_deepspeed: bool) -> list[Result]:
    """All methods on one layout, interleaved: round r runs every method once, in the
    order rotated by r; round 0 warms up (page faults, JIT, thread pools)."""
    state = _State(sizes)
    methods = _methods(state, threads, with_deepspeed)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    torch.set_num_threads(threads)
    with torch.no_grad():
        for rnd in range(repeats + 1):
            for m in rotated(methods, rnd):
                t0 = time.perf_counter()
                m.run()
                dt = time.perf_counter() - t0
                if rnd > 0:
                    times[m.name].append(dt)
            state.step += 1
    numel = sum(sizes)
    out = [Result(layout, m.case, m.name, statistics.median(times[m.name]), m.bytes_per_param,
                  numel) for m in methods]
    del state, methods
    gc.collect()
    return out


def _ratio(r: Result, base: Result | None) -> str:
    # no peer in this case (DeepSpeed not importable, or no fused torch counterpart)
    if base is None:
        return "n/a"
    return f"{r.params_per_s / base.params_per_s:.2f}x"


def format_table(results: list[Result], threads: int) -> str:
    """Markdown: per layout the floor line, then each case's methods with their speed,
    ratios to torch fused and to DeepSpeed in the same case, and % of the in-place floor
    (by bytes moved)."""
    lines = [f"threads={threads}, simd={K.simd_path()}, backend={K.backend()}, OpenMP wait "
             f"policy: {K.wait_policy().value}", ""]
    by_layout: dict[str, dict[str, Result]] = {}
    for r in results:
        by_layout.setdefault(r.layout, {})[r.method] = r
    for layout, rows in by_layout.items():
        probe, triad = rows.get(PROBE), rows[TRIAD]
        # the in-place probe is a C routine: the torch fallback has no floor of its own
        floor = "in-place probe: needs the compiled kernel; "
        if probe:
            # 28 B/param: 16 read + 12 written per fp32 step (DESIGN.md §4)
            floor = (f"in-place {probe.gbps:.1f} GB/s = {probe.params_per_s / 1e6:,.0f} M "
                     "params/s at 28 B/param; ")
        lines.append(f"memory floor, {layout}: {floor}STREAM triad {triad.gbps:.1f} GB/s "
                     "(underestimates it: write-allocate traffic is not counted)")
    lines += ["", "| layout | case | method | M params/s | vs torch fused | vs DeepSpeed | GB/s "
              "| % of floor |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for layout, rows in by_layout.items():
        probe = rows.get(PROBE)
        for r in rows.values():
            fused = rows.get(TORCH_FUSED.get(r.case, ""))
            ds = rows.get(DEEPSPEED.get(r.case, ""))
            pct = "n/a"
            if probe:
                pct = f"{100 * r.gbps / probe.gbps:.0f}%"
            lines.append(f"| {layout} | {r.case} | {r.method} | {r.params_per_s / 1e6:,.0f} | "
                         f"{_ratio(r, fused)} | {_ratio(r, ds)} | {r.gbps:.1f} | {pct} |")
    return "\n".join(lines)


def run_benchmark(numel: int = 2**26, threads: int = 2, repeats: int = 15,
                  layouts: tuple[str, ...] = ("flat", "195"), with_deepspeed: bool = True) -> str:
    results: list[Result] = []
    for layout in layouts:
        # "flat": one tensor (no per-tensor overhead); "195": a GPT's many small tensors
        sizes = [numel]
        if layout != "flat":
            sizes = transformer_sizes(numel)
        print(f"[bench] {layout}: {len(sizes)} tensors, {sum(sizes):,} params, "
              f"{repeats} interleaved rounds ...", flush=True)
        results += run_layout(f"{layout} ({len(sizes)})", sizes, threads, repeats,
                              with_deepspeed)
    table = format_table(results, threads)
    print(table)
    return table
