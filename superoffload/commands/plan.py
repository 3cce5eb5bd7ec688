"""`python -m superoffload simulate|tune`: the planner on the command line (plain tables, --json).

    python -m superoffload simulate --profile gh200 --layers 40 --hidden 5120 --heads 40 \
        --seq 4096 --micro-batch 4 --schedule all --ablation
    python -m superoffload tune --profile gh200 --layers 40 --hidden 5120 --heads 40 --seq 4096
    python -m superoffload tune --profile h100-sxm --hf-config llama-3-8b --seq 4096 \
        --micro-batch 1           # the model from a Hugging Face config (as `plan` reads it)
    python -m superoffload simulate --profile gh200 --schedule superoffload --dp 8 \
        --collective-gbps 450        # 8 GH200 in one NVLink domain; times/memory per rank
    python -m superoffload simulate --facts h200     # predicted vs measured (FACTS.md, H200)
    python -m superoffload capacity --seq 1024      # the largest model per schedule and profile
    python -m superoffload simulate ... --step-order fifo --tail-step unfused   # what-ifs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from superoffload.commands.argtypes import writable_file
from superoffload.config import MiB, OffloadConfig, choices_of
from superoffload.jsonfile import parse_object
from superoffload.plan.cost import KERNELS
from superoffload.plan.schedule import TAIL_STEPS
from superoffload.plan.techniques import SCHEDULES, Techniques


def add_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="predict an iteration on a hardware profile")
    _shape_args(sim)
    sim.add_argument("--schedule", default="all", choices=["all", *SCHEDULES],
                     help="schedule to simulate; 'all' compares the three (default)")
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
    _engine_args(sim)
    sim.add_argument("--facts", choices=["h200", "h200-raw"],
                     help="print the planner's prediction next to the measured table of "
                          "FACTS.md for that machine (plan/facts.py) and exit; h200-raw: "
                          "from the raw measured profile, nothing fitted (out of sample)")
    sim.set_defaults(func=_simulate)

    tune = sub.add_parser("tune", help="search the best OffloadConfig for a hardware profile")
    _shape_args(tune)
    tune.add_argument("--hf-config", metavar="CONFIG",
                      help="the model from a Hugging Face config.json (or its directory, or a "
                           "shipped name), read as `plan --hf-config` reads it; replaces "
                           "--layers/--hidden/--heads/--vocab")
    tune.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                      help="with --hf-config: training dtype of the weights (default bfloat16)")
    tune.add_argument("--device-gb", type=float, help="cap on device memory, GB")
    tune.add_argument("--host-gb", type=float, help="cap on host memory, GB")
    tune.add_argument("--cpu-cores", type=int, help="host cores the job may use")
    tune.add_argument("--max-grad-norm", type=float)
    tune.add_argument("--fix", action="append", default=[], metavar="FIELD=VALUE",
                      help="keep an OffloadConfig field fixed, e.g. --fix ratio=0.9 (repeatable)")
    tune.add_argument("--out", type=writable_file,
                      help="write the chosen OffloadConfig as JSON here")
    tune.add_argument("--allow-bf16-moments", action="store_true",
                      help="let the tuner propose optimizer_state_dtype='bf16' (Adam moments "
                           "in bf16 with stochastic rounding: changes the numerics; proposed "
                           "only when it pays, and said so in the explanation)")
    _engine_args(tune)
    tune.set_defaults(func=_tune)

    cap = sub.add_parser("capacity", help="the largest Llama-shaped model each schedule trains "
                                          "on each profile (docs/planner.md's table)")
    cap.add_argument("--profiles", help="comma-separated preset names (default: every preset)")
    cap.add_argument("--seq", type=int, default=1024)
    cap.add_argument("--micro-batch", type=int, default=1)
    cap.add_argument("--json", action="store_true", help="machine-readable output")
    cap.set_defaults(func=_capacity)


_OFF = {True: False, "superchip": "host"}
"""A technique's "on" default -> its "off" value: casting's off is casting on the host."""
TECHNIQUE_SWITCHES: dict[str, Any] = {
    f.name: _OFF[f.default] for f in dataclasses.fields(Techniques)
    if isinstance(f.default, (bool, str)) and f.default in _OFF}
"""``--disable`` values (``plan.Techniques``'s switches, in declaration order) -> off."""

SHAPE_DEFAULTS = {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 50257}
"""The GPT the shape flags describe when not given (a 12.8B GPT-3-like model)."""

STEP_ORDERS = {"deadline": "deadline", "edf": "deadline", "fifo": "fifo"}
"""--step-order values -> OffloadConfig.step_order ("edf" is the planner's name for "deadline")."""


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-order", choices=sorted(STEP_ORDERS),
                   help="OffloadConfig.step_order: 'deadline' (= 'edf', earliest deadline "
                        "first; the default) or 'fifo' (gradient-ready order)")
    p.add_argument("--tail-step", choices=TAIL_STEPS,
                   help="what-if engine variant: the GPU tail step (default: the engine's, "
                        "fused)")


def _step_order(args: argparse.Namespace) -> dict[str, str]:
    """The OffloadConfig change --step-order asks for (none when it is not given)."""
    return {} if args.step_order is None else {"step_order": STEP_ORDERS[args.step_order]}


def _engine(args: argparse.Namespace, cfg: OffloadConfig) -> Any:
    """The EngineVariant --tail-step asks for, with the step order ``cfg`` selects (as the
    engine resolves it, plan.schedule.engine_for); None without the flag (the engine's)."""
    from dataclasses import replace

    from superoffload.plan.schedule import engine_for

    if args.tail_step is None:
        return None
    return replace(engine_for(cfg), tail_step=args.tail_step)


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="gh200",
                   help="preset name (gh200, gb200, mi300a, h100-pcie, h200-pcie, cpu-laptop, "
                        "h200-pcie-measured), 'local' (measure this machine), or a profile "
                        "JSON file")
    p.add_argument("--layers", type=int, help=f"transformer blocks (default {SHAPE_DEFAULTS['layers']})")
    p.add_argument("--hidden", type=int, help=f"width (default {SHAPE_DEFAULTS['hidden']})")
    p.add_argument("--heads", type=int, help=f"attention heads (default {SHAPE_DEFAULTS['heads']})")
    p.add_argument("--vocab", type=int, help=f"vocabulary (default {SHAPE_DEFAULTS['vocab']})")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--no-checkpointing", action="store_true",
                   help="no activation checkpointing (more activation memory, no recompute)")
    p.add_argument("--rollback-rate", type=float,
                   help="share of iterations that clip/overflow (default: the paper's 0.0012)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel ranks sharing the offloaded state (each holds its shard); "
                        "figures are per rank")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks sharing one host's cores and memory (default 1: one CPU per GPU)")
    p.add_argument("--collective-gbps", type=float,
                   help="override the profile's collective bandwidth per rank, GB/s")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def load_profile(name: str) -> Any:
    """A preset name, "local" (measure this machine) or a profile JSON file."""
    from superoffload import plan

    if name == "local":
        return plan.measure_local()
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return plan.HardwareProfile.from_dict(parse_object(
            path.read_text(), f"profile {path}",
            hint="; write one with plan.measure_local() or HardwareProfile.to_dict()"))
    return plan.profiles.get(name)


def _shape(args: argparse.Namespace) -> Any:
    from superoffload import plan

    common: dict[str, Any] = dict(seq=args.seq, micro_batch=args.micro_batch,
                  activation_checkpointing=not args.no_checkpointing, dp=args.dp,
                  ranks_per_host=args.ranks_per_host)
    if getattr(args, "hf_config", None):
        given = [f"--{k}" for k in SHAPE_DEFAULTS if getattr(args, k) is not None]
        if given:
            raise ValueError(f"--hf-config describes the model: drop {', '.join(given)}")
        dtype = {"dtype": args.dtype} if args.dtype else {}
        return plan.ModelShape.from_hf_config(args.hf_config, **common, **dtype)
    if getattr(args, "dtype", None):
        raise ValueError("--dtype applies to --hf-config only")
    dims: dict[str, Any] = {k: v if (v := getattr(args, k)) is not None else d
                            for k, d in SHAPE_DEFAULTS.items()}
    return plan.ModelShape(**dims, **common)


def _with_collective(prof: Any, args: argparse.Namespace) -> Any:
    if args.collective_gbps is None:
        return prof
    return prof.replace(collective_gbps=args.collective_gbps)


def fail(msg: str, as_json: bool = False) -> int:
    """Exit code 2 with the reason: on stderr, or as {"error": ...} on stdout with --json (a
    script reading the output gets JSON either way). `plan` (commands/fit.py) uses it too."""
    if as_json:
        print(json.dumps({"error": msg}))
    else:
        print(f"error: {msg}", file=sys.stderr)
    return 2


def _simulate(args: argparse.Namespace) -> int:
    from superoffload import plan

    if args.facts:
        return _facts(args)
    try:
        prof, shape = _with_collective(load_profile(args.profile), args), _shape(args)
        changes: dict[str, Any] = {}
        for name in ("ratio", "speculation", "grad_cast", "param_cast", "weights", "cpu_threads",
                     "optimizer_state_dtype"):
            if getattr(args, name) is not None:
                changes[name] = getattr(args, name)
        if args.bucket_mb is not None:
            changes["bucket_bytes"] = args.bucket_mb * MiB
        cfg = OffloadConfig().replace(**changes, **_step_order(args))
        tech = plan.Techniques(kernel=args.kernel, engine=_engine(args, cfg),
                               **({"rollback_rate": args.rollback_rate}
                                  if args.rollback_rate is not None else {}))
        for name in args.disable:
            tech = tech.replace(**{name: TECHNIQUE_SWITCHES[name]})
        schedules = plan.SCHEDULES if args.schedule == "all" else (args.schedule,)
        results = [plan.simulate(shape, prof, s, cfg, tech) for s in schedules]
        abl = plan.ablation.ablation(shape, prof, cfg, tech.rollback_rate) if args.ablation else None
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
        print(_dp_line(shape, prof, results))
    print(_results_table(results))
    if abl is not None:
        print()
        print(abl.table())
    return 0


def _results_table(results: list[Any]) -> str:
    from superoffload.telemetry.events import LANES

    head = (f"{'schedule':13} {'iter ms':>9} {'TFLOPS':>7} "
            + " ".join(f"{lane[:10]:>10}" for lane in LANES) + f" {'device GB':>9} {'host GB':>8}  fits")
    lines = [head, "-" * len(head)]
    for r in results:
        util = " ".join(f"{r.lanes[lane].utilization:>10.0%}" for lane in LANES)
        lines.append(f"{r.plan.schedule:13} {r.iteration_s * 1e3:9.1f} {r.tflops:7.0f} {util} "
                     f"{r.memory['device'] / 1e9:9.1f} {r.memory['host'] / 1e9:8.1f}  "
                     f"{'yes' if r.fits else 'NO: ' + '; '.join(r.problems)}")
    lines.append("(lane columns: busy share of one steady-state iteration)")
    return "\n".join(lines)


def _dp_line(shape: Any, prof: Any, results: list[Any]) -> str:
    coll = ", ".join(f"{r.plan.schedule} {r.collective_s * 1e3:.1f} ms" for r in results)
    return (f"data parallel: {shape.dp} ranks, {shape.ranks_per_host} per host, collectives at "
            f"{prof.collective_gbps:g} GB/s per rank; figures below are per rank "
            f"(collective time per iteration: {coll})")


def _parse_fix(items: list[str]) -> dict[str, Any]:
    fixed: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--fix {item!r}: use FIELD=VALUE, e.g. --fix ratio=0.9")
        key, raw = item.split("=", 1)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        fixed[key.strip()] = value
    return fixed


def _tune(args: argparse.Namespace) -> int:
    from superoffload import plan

    try:
        prof, shape = _with_collective(load_profile(args.profile), args), _shape(args)
        extra = {} if args.rollback_rate is None else {"rollback_rate": args.rollback_rate}
        fixed = {**_parse_fix(args.fix), **_step_order(args)}
        ordered = OffloadConfig().replace(**{k: v for k, v in fixed.items() if k == "step_order"})
        cons = plan.Constraints(
            device_memory_bytes=None if args.device_gb is None else args.device_gb * 1e9,
            host_memory_bytes=None if args.host_gb is None else args.host_gb * 1e9,
            cpu_cores=args.cpu_cores, max_grad_norm=args.max_grad_norm, fixed=fixed,
            engine=_engine(args, ordered),
            allow_bf16_moments=args.allow_bf16_moments, **extra)
        cfg, why, pred = plan.tune(shape, prof, cons)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return fail(str(exc), args.json)
    if args.out is not None:
        try:
            args.out.write_text(json.dumps(cfg.to_dict(), indent=1, default=float))
        except OSError as exc:  # checked at parse time; the folder may change meanwhile
            return fail(f"--out {args.out}: cannot write ({exc.strerror or exc}); choose "
                        "another path")
    from superoffload.plan.calibrate import calibration_state

    state = calibration_state(prof)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "explanation": why,
                          "prediction": pred.summary(), "calibrated": state.calibrated},
                         indent=1, default=float))
        return 0
    print(why)
    print(f"predictions: {state.text}")
    if shape.dp > 1:
        print(_dp_line(shape, prof, [pred]))
    print()
    keys = ("bucket_bytes", "ratio", "speculation", "grad_cast", "param_cast", "weights",
            "cpu_cores_frac", "prefetch_depth", "optimizer_state_dtype", "step_order",
            "grad_accum_on", "max_grad_norm")
    print("OffloadConfig(" + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in keys) + ")")
    print()
    print(_results_table([pred]))
    return 0


def _capacity(args: argparse.Namespace) -> int:
    """The largest-model table (plan/largest.py), one row per profile."""
    from superoffload import plan
    from superoffload.plan import largest

    try:
        names = args.profiles.split(",") if args.profiles else plan.profiles.names()
        profiles = [load_profile(n.strip()) for n in names]
        rows = largest.table(profiles, seq=args.seq, micro_batch=args.micro_batch)
    except ValueError as exc:
        return fail(str(exc), args.json)
    if args.json:
        print(json.dumps({"seq": args.seq, "micro_batch": args.micro_batch, "rows": rows},
                         indent=1))
        return 0
    print(f"Largest Llama-shaped model (billions of parameters), seq {args.seq} x micro-batch "
          f"{args.micro_batch}, activation checkpointing on (plan/largest.py):")
    print()
    print(largest.markdown(rows))
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
    print(facts.format_table(then, now, next_label="engine now"))
    print()
    print(f"the H200 speed targets for the engine now, relative to the measured plain row "
          f"({facts.PLAIN_MS} ms) -- predictions, not measurements:")
    print(facts.format_targets(facts.targets()))
    return 0
