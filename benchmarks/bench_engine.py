"""Engine benchmark: iteration time of one model under several schedules, measured and predicted.

  plain   -- no offload: torch.optim.AdamW(fused=True) on the device
  zero    -- a ZeRO-Offload-style schedule through our engine: every bucket on the CPU
             (ratio=1), no speculation (the CPU steps only after backward's validation),
             casting on the host (ZeRO-Offload moves 16-bit gradients and weights)
  super   -- the engine with its preset settings (tiny_cpu on a CPU host, pcie_host on CUDA),
             one row per ratio of --ratios (default: the preset's ratio)
  tuned   -- (--tuned) the planner's pick (plan.tune) for this model on this machine

Each row prints the planner's prediction next to the measurement: the profile is
``plan.measure_local()`` (or --profile), its achieved FLOP/s fitted to the measured plain row
(``plan.calibrate.fit_compute``: the one fitted figure), the schedule the rule book resolves for
each config, the engine variant the engine runs for it (plan.schedule.engine_for: ENGINE with
the config's step_order, as runtime/engine.py resolves it). Without
--sequential the variants run interleaved in rounds in one process (the host is shared: between
processes +-10% is noise, FACTS.md) on deep copies of one model with the same batches; with it,
one after another, each engine closed before the next is built (bounds host and device memory
for large models). Reported: medians of iteration time, the prediction and its error,
tokens/s, ratios, the exposed optimizer time (engine telemetry; for plain the measured
optimizer step, exposed by construction), and the peak device memory beside the planner's
device figure (``torch.cuda.max_memory_allocated`` with --sequential on CUDA, else
``DeviceMeter``).

    python benchmarks/bench_engine.py                 # CPU: the "device" is the CPU too
    python benchmarks/bench_engine.py --device cuda --layers 24 --hidden 2048 --heads 16 \\
        --dtype bf16 --batch 8 --seq 1024 --ratios 0.3,0.5,0.7,0.9 --tuned --sequential

On a CPU-only host the device and the CPU optimizer share the same cores, so offloading
cannot win there (and the planner, which models them as separate lanes, over-predicts the
speed); the CPU run checks the machinery and the overheads, the CUDA run the idea.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import superoffload as so
from superoffload import plan, presets
from superoffload.config import MiB, OffloadConfig
from superoffload.data import BatchSampler, load_tokens
from superoffload.models import GPT, PRESETS
from superoffload.models.gpt import GPTConfig
from superoffload.plan.calibrate import fit_compute
from superoffload.plan.schedule import engine_for
from superoffload.plan.techniques import PAPER_CLIP_RATE
from superoffload.runtime.device_meter import DeviceMeter
from superoffload.telemetry.metrics import summarize


@dataclass
class Result:
    name: str
    config: OffloadConfig | None
    iter_s: list[float] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)
    """Per-round telemetry medians (engine schedules only)."""
    peak_device_bytes: float | None = None
    """Measured peak device memory: ``torch.cuda.max_memory_allocated`` with --sequential on
    CUDA (the allocator sees one schedule at a time), else ``DeviceMeter`` (weights,
    gradients until freed, saved activations, device optimizer state)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.iter_s)

    def clear(self) -> None:
        self.iter_s.clear()
        self.exposed_s.clear()
        self.extra.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Plain:
    """No offload, the usual mixed precision: fp32 weights and Adam state on the device, a
    low-precision model runs under autocast (so every schedule keeps fp32 masters)."""

    def __init__(self, model: torch.nn.Module, lr: float, device: torch.device,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        low = next(model.parameters()).dtype
        self.model, self.device, self.batches = model.float(), device, batches
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                     weight_decay=0.1, fused=True)
        self.autocast = torch.autocast(device.type, dtype=low, enabled=low != torch.float32)
        self.res = Result("plain", None)
        self.meter = DeviceMeter(self.model)

    def run(self, n: int) -> Result:
        with self.meter.track():
            self._run(n)
        state = sum(t.numel() * t.element_size() for st in self.opt.state.values()
                    for t in st.values() if isinstance(t, torch.Tensor))
        self.res.peak_device_bytes = self.meter.peak_bytes + state  # AdamW's m, v on the device
        return self.res

    def _run(self, n: int) -> None:
        for k in range(n):
            x, y = self.batches[k % len(self.batches)]
            t0 = time.perf_counter()
            with self.autocast:
                loss = self.model(x, y)
            loss.backward()
            _sync(self.device)
            t1 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            _sync(self.device)
            t2 = time.perf_counter()
            self.res.iter_s.append(t2 - t0)
            self.res.exposed_s.append(t2 - t1)  # nothing overlaps the step: all of it exposed

    def close(self) -> None:
        self.opt.state.clear()


class _Engine:
    def __init__(self, name: str, model: torch.nn.Module, lr: float, config: OffloadConfig,
                 device: torch.device, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model, self.device, self.batches = model, device, batches
        self.engine = so.initialize(model, optimizer={"lr": lr, "betas": (0.9, 0.95),
                                                      "weight_decay": 0.1}, config=config)
        self.res = Result(name, config)
        self.meter = DeviceMeter(model, engine=self.engine)

    def run(self, n: int) -> Result:
        with self.meter.track():
            self._run(n)
        self.res.peak_device_bytes = self.meter.peak_bytes
        return self.res

    def _run(self, n: int) -> None:
        # iteration time = time between consecutive returns of step(): what a training loop
        # sees, with the CPU tail of one iteration allowed to overlap the next forward
        engine, res = self.engine, self.res
        seq = engine.telemetry.last_seq
        _sync(self.device)
        last = time.perf_counter()
        for k in range(n):
            x, y = self.batches[k % len(self.batches)]
            loss = self.model(x, y)
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

    def close(self) -> None:
        self.engine.close()


def _ratios(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        out = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--ratios {text!r}: use comma-separated fractions, e.g. 0.3,0.5,0.7"
                         ) from None
    if not out or not all(0.0 <= r <= 1.0 for r in out):
        raise SystemExit(f"--ratios {text!r}: every ratio must be in [0, 1]")
    return out


def _profile(name: str, quick: bool) -> plan.HardwareProfile:
    if name == "local":
        return plan.measure_local(quick=quick, progress=False)
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return plan.HardwareProfile.from_dict(json.loads(path.read_text()))
    return plan.profiles.get(name)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", choices=tuple(PRESETS), default=None,
                    help="GPT preset (default: small on CPU, medium on CUDA); see --layers")
    ap.add_argument("--layers", type=int, help="GPT shape: blocks (overrides --model)")
    ap.add_argument("--hidden", type=int, help="GPT shape: width (with --layers)")
    ap.add_argument("--heads", type=int, help="GPT shape: attention heads (with --layers)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="model dtype (default: fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds (interleaved unless --sequential)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant")
    ap.add_argument("--preset", choices=tuple(presets.CONFIG_PRESETS), default=None,
                    help="settings of the super rows (default: tiny_cpu on CPU, pcie_host on CUDA)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket size of zero and super")
    ap.add_argument("--ratio", type=float, default=None, help="ratio of the super row")
    ap.add_argument("--ratios", default=None, help="a sweep: one super row per ratio, e.g. 0.3,0.5")
    ap.add_argument("--tuned", action="store_true", help="add a row with the planner's pick")
    ap.add_argument("--no-zero", action="store_true", help="skip the ZeRO-Offload-style row")
    ap.add_argument("--sequential", action="store_true",
                    help="run the variants one after another, closing each (large models)")
    ap.add_argument("--profile", default="local",
                    help="planner profile: 'local' (plan.measure_local, cached), a preset name "
                         "or a profile JSON file; 'none' skips the predictions")
    ap.add_argument("--quick-profile", action="store_true",
                    help="with --profile local: the quick measurement (default on a CPU host)")
    ap.add_argument("--max-grad-norm", type=float, default=0.0,
                    help="clipping for zero and super; 0 (default) disables it, "
                         "so plain is comparable")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return ap.parse_args(argv)


def _model(args: argparse.Namespace, cuda: bool, seq: int) -> tuple[GPT, str]:
    if args.layers is not None:
        if args.hidden is None or args.heads is None:
            raise SystemExit("--layers needs --hidden and --heads too")
        cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                        block_size=max(seq, 64))
        return GPT(cfg), f"{args.layers}x{args.hidden}"
    preset = args.model or ("medium" if cuda else "small")
    return GPT(PRESETS[preset](block_size=max(seq, 64))), preset


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    batch, seq = args.batch or (16 if cuda else 8), args.seq or (256 if cuda else 128)
    torch.manual_seed(0)
    gpt, model_name = _model(args, cuda, seq)
    base = gpt.to(device=device, dtype=dtype)
    sampler = BatchSampler(load_tokens(), batch_size=batch, seq_len=seq, seed=0, device=device)
    batches = [sampler.next_batch() for _ in range(8)]
    super_cfg = presets.CONFIG_PRESETS[args.preset or ("pcie_host" if cuda else "tiny_cpu")]()
    changes: dict[str, Any] = {"device": str(device), "max_grad_norm": args.max_grad_norm or None}
    if not cuda:
        changes["pin_memory"] = False
    if args.bucket_mb:
        changes["bucket_bytes"] = int(args.bucket_mb * MiB)
    super_cfg = super_cfg.replace(**changes)
    ratios = _ratios(args.ratios) or [args.ratio if args.ratio is not None else super_cfg.ratio]
    variants: list[tuple[str, OffloadConfig | None]] = [("plain", None)]
    if not args.no_zero:
        variants.append(("zero", super_cfg.replace(ratio=1.0, speculation="off",
                                                   grad_cast="host", param_cast="host")))
    variants += [(f"super {r:g}", super_cfg.replace(ratio=r)) for r in ratios]
    shape = plan.ModelShape.from_module(base, seq=seq, micro_batch=batch,
                                        activation_checkpointing=base.config.checkpointing)
    prof = None
    if args.profile != "none":
        prof = _profile(args.profile, args.quick_profile or not cuda)
    tech = plan.Techniques(rollback_rate=PAPER_CLIP_RATE if args.max_grad_norm else 0.0)
    lr = 1e-4

    def build(name: str, cfg: OffloadConfig | None) -> _Plain | _Engine:
        model = copy.deepcopy(base)
        if cfg is None:
            return _Plain(model, lr, device, batches)
        return _Engine(name, model, lr, cfg, device, batches)

    results: dict[str, Result] = {}
    live: dict[str, _Plain | _Engine] = {}
    try:
        # plain first: its time fits the planner's compute rate, which the tuner needs
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        plain = build("plain", None)
        live["plain"] = plain
        plain.run(args.warmup)
        plain.res.clear()
        plain.run(args.iters)
        fitted = _fit(prof, shape, plain.res.median_s)
        if args.tuned and fitted is not None:
            tuned, _, _ = plan.tune(shape, fitted, plan.Constraints(
                rollback_rate=tech.rollback_rate,
                fixed={k: getattr(super_cfg, k)
                       for k in ("device", "pin_memory", "max_grad_norm")}))
            variants.append(("tuned", tuned.replace(extra={})))
        if args.sequential:
            for _ in range(args.rounds - 1):
                plain.run(args.iters)
            if cuda:  # copies of the base model and batches are resident too: the same in
                plain.res.peak_device_bytes = torch.cuda.max_memory_allocated(device)  # each row
            results["plain"] = plain.res
            plain.close()
            del live["plain"]
            for name, cfg in variants[1:]:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                runner = live[name] = build(name, cfg)
                runner.run(args.warmup)
                runner.res.clear()
                for _ in range(args.rounds):
                    runner.run(args.iters)
                if cuda:  # the allocator's own figure: this schedule alone was on the device
                    runner.res.peak_device_bytes = torch.cuda.max_memory_allocated(device)
                results[name] = runner.res
                runner.close()
                del live[name]
        else:
            for name, cfg in variants[1:]:  # warm-up: allocations, first touch, thread start
                live[name] = build(name, cfg)
                live[name].run(args.warmup)
                live[name].res.clear()
            for _ in range(args.rounds):
                for runner in live.values():
                    runner.run(args.iters)
            for name in live:
                results[name] = live[name].res
    finally:
        for runner in live.values():
            runner.close()
    fitted = _fit(prof, shape, results["plain"].median_s)
    rows = _rows(results, shape, fitted, tech, batch * seq)
    meta = {"device": str(device) if not cuda else torch.cuda.get_device_name(device),
            "host": f"{torch.get_num_threads()} torch threads", "model": model_name,
            "params": shape.params, "dtype": str(dtype).split(".")[-1], "batch": batch,
            "seq": seq, "iters": args.iters * args.rounds,
            "profile": None if fitted is None else fitted.name,
            "achieved_tflops": None if fitted is None else fitted.device_achieved_tflops,
            "engine": {name: repr(engine_for(cfg)) for name, cfg in variants if cfg is not None},
            "configs": {name: {k: getattr(cfg, k) for k in
                               ("bucket_bytes", "ratio", "speculation", "grad_cast",
                                "param_cast", "cpu_cores_frac", "cpu_threads", "step_order",
                                "optimizer_state_dtype")}
                        for name, cfg in variants if cfg is not None}}
    _print(meta, rows)
    out = {"meta": meta, "rows": rows}
    if args.json:
        print(json.dumps(out))
    sys.stdout.flush()
    return out


def _fit(prof: plan.HardwareProfile | None, shape: plan.ModelShape, plain_s: float
         ) -> plan.HardwareProfile | None:
    """The profile with its compute rate fitted to the measured plain iteration."""
    if prof is None:
        return None
    try:
        return fit_compute(prof, shape, plain_s)
    except ValueError as exc:  # a plain run faster than the profile's non-compute part
        print(f"[bench] prediction skipped: {exc}")
        return None


def _rows(results: dict[str, Result], shape: plan.ModelShape,
          prof: plan.HardwareProfile | None, tech: plan.Techniques, tokens: int
          ) -> list[dict[str, Any]]:
    plain = results["plain"].median_s
    zero = results["zero"].median_s if "zero" in results else None
    rows = []
    for name, r in results.items():
        predicted = predicted_bytes = None
        if prof is not None:
            system = "gpu" if r.config is None else "superoffload"
            sim = plan.simulate(shape, prof, system, r.config, tech)
            predicted, predicted_bytes = sim.iteration_s, sim.memory["device"]
        peak = r.peak_device_bytes
        rows.append({
            "schedule": name, "ratio": None if r.config is None else r.config.ratio,
            "iter_ms": r.median_s * 1e3,
            "predicted_ms": None if predicted is None else predicted * 1e3,
            "error": None if predicted is None else predicted / r.median_s - 1,
            "tokens_per_s": tokens / r.median_s, "vs_plain": plain / r.median_s,
            "vs_zero": None if zero is None else zero / r.median_s,
            "exposed_optimizer_ms": statistics.median(r.exposed_s) * 1e3,
            "device_peak_mb": None if peak is None else peak / 1e6,
            "device_predicted_mb": None if predicted_bytes is None else predicted_bytes / 1e6,
            "device_error": None if peak is None or predicted_bytes is None
            else predicted_bytes / peak - 1,
            **{k: statistics.median(v) for k, v in r.extra.items() if v},
        })
    return rows


def _print(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"{meta['model']} GPT, {meta['params'] / 1e6:.2f} M params, {meta['dtype']}, batch "
          f"{meta['batch']} x {meta['seq']}, on {meta['device']} ({meta['host']}); medians of "
          f"{meta['iters']} iterations; predictions: {meta['profile'] or 'none'} with compute "
          f"fitted to plain ({meta['achieved_tflops'] or 0:.4g} TFLOP/s), "
          f"{' / '.join(sorted(set(meta['engine'].values())))}")
    print(f"{'schedule':<10} {'iter ms':>9} {'pred ms':>9} {'error':>7} {'tokens/s':>10} "
          f"{'vs plain':>9} {'vs zero':>8} {'exposed opt ms':>15} {'dev idle':>9} {'overlap':>8} "
          f"{'dev MB':>9} {'pred MB':>9} {'error':>7}")
    for row in rows:
        pred = f"{row['predicted_ms']:9.1f}" if row["predicted_ms"] is not None else f"{'-':>9}"
        err = f"{row['error']:+7.1%}" if row["error"] is not None else f"{'-':>7}"
        vz = f"{row['vs_zero']:7.2f}x" if row["vs_zero"] is not None else f"{'-':>8}"
        idle = f"{row['device_idle_frac']:.0%}" if "device_idle_frac" in row else "-"
        ov = f"{row['cpu_overlap_frac']:.0%}" if "cpu_overlap_frac" in row else "-"
        gb = f"{row['device_peak_mb']:9,.1f}" if row["device_peak_mb"] is not None else f"{'-':>9}"
        pgb = (f"{row['device_predicted_mb']:9,.1f}" if row["device_predicted_mb"] is not None
               else f"{'-':>9}")
        gerr = f"{row['device_error']:+7.1%}" if row["device_error"] is not None else f"{'-':>7}"
        print(f"{row['schedule']:<10} {row['iter_ms']:>9.1f} {pred} {err} "
              f"{row['tokens_per_s']:>10,.0f} {row['vs_plain']:>8.2f}x {vz} "
              f"{row['exposed_optimizer_ms']:>15.1f} {idle:>9} {ov:>8} {gb} {pgb} {gerr}")


if __name__ == "__main__":
    main()
