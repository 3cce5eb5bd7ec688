"""How well does the planner predict this machine? (docs/planner.md, "Accuracy")

For each model (default: the CPU demo's ``small`` and ``medium``, batch 16 x 128, fp32, the
tiny_cpu preset the CLI uses on a CPU) one engine trains while the ratio rotates through
--ratios in blocks of --block iterations (interleaved, so every ratio sees the same load),
after --calibrate iterations at the first ratio that the auto-calibration fits on, as
``superoffload train`` does (runtime/calibrator.py). Printed per ratio: the measured median
iteration time over the interleaved rounds only (first iteration after each switch dropped;
the calibration window is not a measurement), the prediction before
calibration (``measure_local(quick=True)`` + ``probe_model`` for the model: its GEMMs,
attention, element-wise passes, dispatch) and after, with the errors. Then the
repeatability of the uncalibrated prediction: --repeat back-to-back ``measure_local(quick=
True, force)`` profiles predicting the first model, their spread, and the load average.

    flock /tmp/so-bench.lock .venv/bin/python benchmarks/bench_planner_accuracy.py
    .venv/bin/python benchmarks/bench_planner_accuracy.py --models small --rounds 2 --json

Targets: after calibration within +-20% at three ratios for both models; before
calibration within 2x; the repeated quick profiles' predictions within 10% of each other on
an idle machine. Speed is measured here; tests check the maths (tests/test_plan_accuracy.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

import superoffload as so
from superoffload import plan, presets
from superoffload.data import BatchSampler, load_tokens
from superoffload.models import GPT, PRESETS
from superoffload.plan.autocal import calibrate_run
from superoffload.plan.probe import probe_model
from superoffload.plan.timing import load_average


def run_model(name: str, ratios: list[float], args: argparse.Namespace,
              base: plan.HardwareProfile) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg_model = PRESETS[name]()
    cfg_model.block_size = max(cfg_model.block_size, args.seq)
    model = GPT(cfg_model)
    shape = plan.ModelShape.from_module(model, seq=args.seq, micro_batch=args.batch,
                                        activation_checkpointing=False)
    probed = probe_model(shape, base, trials=5)
    config = presets.tiny_cpu().replace(ratio=ratios[0])
    batches = BatchSampler(load_tokens(), batch_size=args.batch, seq_len=args.seq, seed=0)
    times: dict[float, list[float]] = {r: [] for r in ratios}
    with so.initialize(model, optimizer={"lr": 1e-4}, config=config) as engine:

        def step() -> float:
            x, y = batches.next_batch()
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            return engine.telemetry.scalars("iteration_s")[-1].value

        for _ in range(args.warmup):
            step()
        first = engine.iteration
        for _ in range(args.calibrate):  # what the auto-calibration sees (not a measurement)
            step()
        last = engine.iteration - 1
        spans = [s for s in engine.telemetry.spans() if first <= s.iteration <= last]
        iters = [(s.iteration, s.value) for s in engine.telemetry.scalars("iteration_s")
                 if first <= s.iteration <= last]
        report = calibrate_run(probed, shape, engine.config, spans, iters,
                               cpu_threads=engine.schedule.threads)
        for _ in range(args.rounds):
            for r in ratios:
                engine.reconfigure(ratio=r)
                step()  # the change lands in this iteration: not measured
                times[r] += [step() for _ in range(args.block)]
        cal_profile = report.profile
        rows = []
        tech = plan.Techniques(rollback_rate=0.0)
        for r in ratios:
            cfg = engine.config.replace(ratio=r)
            measured = statistics.median(times[r])
            before = plan.simulate(shape, probed, config=cfg, techniques=tech).iteration_s
            after = plan.simulate(shape, cal_profile, config=cfg, techniques=tech).iteration_s
            rows.append({"ratio": r, "measured_ms": measured * 1e3, "n": len(times[r]),
                         "before_ms": before * 1e3, "after_ms": after * 1e3,
                         "before_error": before / measured - 1,
                         "after_error": after / measured - 1})
    return {"model": name, "params": shape.params, "rows": rows, "calibration": report.line(),
            "probe": probed.extra.get("probe", {}), "flags": list(probed.flags)}


def repeatability(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(PRESETS[args.models[0]]())
    shape = plan.ModelShape.from_module(model, seq=args.seq, micro_batch=args.batch,
                                        activation_checkpointing=False)
    config = presets.tiny_cpu()
    preds, loads = [], []
    for _ in range(args.repeat):
        loads.append(load_average())
        prof = plan.measure_local(quick=True, force=True, use_cache=False, progress=False)
        prof = probe_model(shape, prof, trials=5)
        preds.append(plan.simulate(shape, prof, config=config).iteration_s * 1e3)
    mid = statistics.median(preds)
    return {"predicted_ms": preds, "spread": (max(preds) - min(preds)) / mid,
            "load_average": loads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=["small", "medium"])
    p.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.5, 0.25, 1.0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibrate", type=int, default=10)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    base = plan.measure_local(quick=True, progress=False)
    out = {"load_average_start": load_average(), "profile": base.name,
           "models": [run_model(m, args.ratios, args, base) for m in args.models],
           "repeatability": repeatability(args) if args.repeat > 1 else None,
           "load_average_end": load_average()}
    if args.json:
        print(json.dumps(out, indent=1, default=float))
        return 0
    print(f"profile {base.name}; load average {out['load_average_start']} at start, "
          f"{out['load_average_end']} at the end (2 usable cores; a shared machine)")
    for m in out["models"]:
        print(f"\n{m['model']} ({m['params'] / 1e6:.2f} M params), batch {args.batch} x "
              f"{args.seq}, tiny_cpu preset")
        print(f"  {m['calibration']}")
        print(f"  {'ratio':>5} {'measured ms':>11} {'n':>3} {'before ms':>10} {'error':>7} "
              f"{'after ms':>9} {'error':>7}")
        for r in m["rows"]:
            print(f"  {r['ratio']:5.2f} {r['measured_ms']:11.1f} {r['n']:3d} "
                  f"{r['before_ms']:10.1f} {r['before_error']:+7.0%} "
                  f"{r['after_ms']:9.1f} {r['after_error']:+7.0%}")
    rep = out["repeatability"]
    if rep:
        print(f"\nrepeatability: {len(rep['predicted_ms'])} back-to-back quick profiles predict "
              + ", ".join(f"{x:.1f}" for x in rep["predicted_ms"]) + f" ms: spread "
              f"{rep['spread']:.0%} (load average {rep['load_average']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
