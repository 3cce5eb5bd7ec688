"""`python -m superoffload simulate|capacity`: the planner's prediction on the command line
(plain tables, --json).

    python -m superoffload simulate --profile gh200 --layers 40 --hidden 5120 --heads 40 \
        --seq 4096 --micro-batch 4 --system all --ablation
    python -m superoffload simulate --profile gh200 --system superoffload --dp 8 \
        --collective-gbps 450        # 8 GH200 in one NVLink domain; times/memory per rank
    python -m superoffload simulate --facts h200     # predicted vs measured (FACTS.md, H200)
    python -m superoffload capacity --seq 1024      # the largest model per system and profile
    python -m superoffload simulate ... --step-order fifo --tail-step unfused   # what-ifs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from superoffload.commands.planner_args import (
    dp_line,
    engine_args,
    engine_variant,
    fail,
    load_profile,
    machine_args,
    results_table,
    shape_args,
    shape_of,
    step_order_change,
    with_collective,
    with_machine,
)
from superoffload.config import MiB, OffloadConfig, choices_of
from superoffload.plan.cost import KERNELS
from superoffload.plan.techniques import SYSTEMS, Techniques


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="predict an iteration on a hardware profile")
    shape_args(sim)
    sim.add_argument("--system", default="all", choices=["all", *SYSTEMS],
                     help="system to simulate; 'all' compares the three (default)")
    sim.add_argument("--ratio", type=float, help="OffloadConfig.ratio (default 0.9)")
    sim.add_argument("--bucket-mb", type=int, help="bucket size in MiB (default 64)")
    sim.add_argument("--speculation", choices=choices_of("speculation"))
    sim.add_argument("--grad-cast", choices=choices_of("grad_cast"))
    sim.add_argument("--param-cast", choices=choices_of("param_cast"))
    sim.add_argument("--weights", choices=choices_of("weights"))
    sim.add_argument("--cpu-threads", type=int)
    sim.add_argument("--optimizer-state-dtype", choices=choices_of("optimizer_state_dtype"),
                     help="host Adam moments: fp32 (default) or bf16 with stochastic rounding "
                          "(changes the numerics; docs/kernel.md)")
    sim.add_argument("--kernel", choices=KERNELS, default=KERNELS[0])
    sim.add_argument("--disable", action="append", default=[],
                     choices=tuple(TECHNIQUE_SWITCHES),
                     help="switch a SuperOffload technique off (repeatable)")
    sim.add_argument("--ablation", action="store_true", help="also print the ablation table")
    engine_args(sim)
    sim.add_argument("--facts", choices=["h200", "h200-raw"],
                     help="print the planner's prediction next to the measured table of "
                          "FACTS.md for that machine (plan/facts.py) and exit; h200-raw: "
                          "from the raw measured profile, nothing fitted (out of sample)")
    sim.set_defaults(func=_simulate)


def add_capacity_parser(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("capacity", help="the largest Llama-shaped model each system trains "
                                          "on each profile (docs/planner.md's table)")
    cap.add_argument("--profiles", help="comma-separated preset names (default: every preset)")
    cap.add_argument("--seq", type=int, default=1024)
    cap.add_argument("--micro-batch", type=int, default=1)
    machine_args(cap)
    cap.add_argument("--json", action="store_true", help="machine-readable output")
    cap.set_defaults(func=_capacity)


DEFAULT_TIER = "nvme-gen4x4"
"""The storage tier ``capacity`` gives a profile that has none (``--storage`` overrides it
for every profile): four PCIe Gen4 drives, FACTS.md's ZeRO-Infinity array."""


_OFF = {True: False, "superchip": "host"}
"""A technique's "on" default -> its "off" value: casting's off is casting on the host."""
TECHNIQUE_SWITCHES: dict[str, Any] = {
    f.name: _OFF[f.default] for f in dataclasses.fields(Techniques)
    if isinstance(f.default, (bool, str)) and f.default in _OFF}
"""``--disable`` values (``plan.Techniques``'s switches, in declaration order) -> off."""


def _simulate(args: argparse.Namespace) -> int:
    from superoffload import plan

    if args.facts:
        return _facts(args)
    try:
        prof = with_machine(with_collective(load_profile(args.profile), args), args)
        shape = shape_of(args)
        changes: dict[str, Any] = {}
        for name in ("ratio", "speculation", "grad_cast", "param_cast", "weights", "cpu_threads",
                     "optimizer_state_dtype"):
            if getattr(args, name) is not None:
                changes[name] = getattr(args, name)
        if args.bucket_mb is not None:
            changes["bucket_bytes"] = args.bucket_mb * MiB
        cfg = OffloadConfig().replace(**changes, **step_order_change(args))
        extra = {}
        # not given: Techniques' own default rate stands
        if args.rollback_rate is not None:
            extra["rollback_rate"] = args.rollback_rate
        tech = plan.Techniques(kernel=args.kernel, engine=engine_variant(args, cfg), **extra)
        for name in args.disable:
            tech = tech.replace(**{name: TECHNIQUE_SWITCHES[name]})
        systems = plan.SYSTEMS if args.system == "all" else (args.system,)
        results = [plan.simulate(shape, prof, s, cfg, tech) for s in systems]
        abl = None
        if args.ablation:
            abl = plan.ablation.ablation(shape, prof, cfg, tech.rollback_rate)
    except ValueError as exc:
        return fail(str(exc), args.json)
    from superoffload.plan.calibrate import calibration_state

    state = calibration_state(prof)
    if args.json:
        out: dict[str, Any] = {"results": [r.summary() for r in results],
                               "calibrated": state.calibrated}
        if abl is not None:
            out["ablation"] = abl.to_dict()
        print(json.dumps(out, indent=1, default=float))
        return 0
    print(f"{prof.name}: {prof.device_name} + {prof.cpu_name}; predictions {state.text}")
    for flag in prof.flags:
        print(f"note: {flag}")
    print(f"model: {shape.params / 1e9:.2f}B params, {shape.layers} x {shape.hidden}, seq "
          f"{shape.seq} x batch {shape.micro_batch}, checkpointing "
          f"{'on' if shape.activation_checkpointing else 'off'}")
    if shape.dp > 1:
        print(dp_line(shape, prof, results))
    print(results_table(results))
    if abl is not None:
        print()
        print(abl.table())
    return 0


def _capacity(args: argparse.Namespace) -> int:
    """The largest-model table (plan/largest.py), one row per profile."""
    from superoffload import plan
    from superoffload.plan import largest, storage_presets

    try:
        names = args.profiles.split(",") if args.profiles else plan.profiles.names()
        profiles = [with_machine(load_profile(n.strip()), args) for n in names]
        given = [p.name for p in profiles if not p.has_storage]
        # the table's storage column needs a tier: a profile without one gets the default
        tier = storage_presets.by_name(DEFAULT_TIER)
        profiles = [p if p.has_storage else storage_presets.with_tier(p, tier)
                    for p in profiles]
        rows = largest.table(profiles, seq=args.seq, micro_batch=args.micro_batch)
    except ValueError as exc:
        return fail(str(exc), args.json)
    tiers = {p.name: p.storage_name for p in profiles}
    # say which tiers were lent, not the profile's own
    for name in set(given):
        tiers[name] += f" ({DEFAULT_TIER}: the profile has none)"
    if args.json:
        print(json.dumps({"seq": args.seq, "micro_batch": args.micro_batch, "rows": rows,
                          "storage": tiers}, indent=1))
        return 0
    print(f"Largest Llama-shaped model (billions of parameters), seq {args.seq} x micro-batch "
          f"{args.micro_batch}, activation checkpointing on, one GPU's share of its host "
          "(plan/largest.py):")
    print()
    print(largest.markdown(rows))
    print()
    print("storage tiers: " + "; ".join(f"{k}: {v}" for k, v in tiers.items()))
    return 0


def _facts(args: argparse.Namespace) -> int:
    """Predicted next to measured for FACTS.md's H200 table: with the engine it was measured
    with (plan.facts.H200_ENGINE) and, as a prediction only, with the engine that runs now."""
    from superoffload.plan import facts
    from superoffload.plan.schedule import ENGINE

    if args.facts == "h200-raw":
        print("FACTS.md's H200 rows predicted from the raw measured profile (the 708 TFLOP/s "
              "matmul probe, nothing fitted), with the engine they were measured with")
        print(facts.out_of_sample_table())
        return 0
    then = facts.calibration_table()
    now = facts.calibration_table(engine=ENGINE)
    if args.json:
        print(json.dumps([{"schedule": r.row.label, "measured_ms": r.row.measured_ms,
                           "predicted_ms": r.predicted_ms, "error": r.error,
                           "fitted": r.row.fitted, "target": r.row.target,
                           "predicted_engine_now_ms": n.predicted_ms}
                          for r, n in zip(then, now)], indent=1))
        return 0
    shape = facts.H200_SHAPE
    print(f"FACTS.md, H200 machine: GPT {shape.layers} x {shape.hidden} ({shape.params / 1e9:.2f} "
          f"B params, vocab {shape.vocab}), bf16, batch {shape.micro_batch} x {shape.seq}; "
          "profile h200-pcie-measured")
    print("predicted with the engine it was measured with (FIFO stepping, unfused tail step); "
          "last column: the engine now (EDF, copy first, small buckets merged, fused tail) -- "
          "a prediction, not yet measured on a GPU")
    print(facts.format_calibration_table(then, now, next_label="engine now"))
    print()
    print(f"the H200 speed targets for the engine now, relative to the measured plain row "
          f"({facts.PLAIN_MS} ms) -- predictions, not measurements:")
    print(facts.format_targets(facts.targets()))
    return 0
