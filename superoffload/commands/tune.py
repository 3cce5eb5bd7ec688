"""`python -m superoffload tune`: the best OffloadConfig for a model on a hardware profile.

    python -m superoffload tune --profile gh200 --layers 40 --hidden 5120 --heads 40 --seq 4096
    python -m superoffload tune --profile h100-sxm --hf-config llama-3-8b --seq 4096 \
        --micro-batch 1           # the model from a Hugging Face config (as `plan` reads it)
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from superoffload.commands.argtypes import writable_file
from superoffload.commands.planner_args import (
    dp_line,
    dtype_arg,
    engine_args,
    engine_variant,
    fail,
    load_profile,
    memory_caps,
    results_table,
    shape_args,
    shape_of,
    step_order_change,
    with_collective,
    with_machine,
)
from superoffload.config import OffloadConfig


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="search the best OffloadConfig for a hardware profile")
    shape_args(tune)
    tune.add_argument("--hf-config", metavar="CONFIG",
                      help="the model from a Hugging Face config.json (or its directory, or a "
                           "shipped name), read as `plan --hf-config` reads it; replaces "
                           "--layers/--hidden/--heads/--vocab")
    dtype_arg(tune, "with --hf-config: training dtype of the weights (default bf16)")
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
    tune.add_argument("--use-storage", action="store_true",
                      help="keep what host memory cannot hold (optimizer state, weight-flow's "
                           "weights) on the profile's storage tier (--storage names one); the "
                           "config's storage_path is then a placeholder: name a folder")
    engine_args(tune)
    tune.set_defaults(func=_tune)


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
        prof = with_machine(with_collective(load_profile(args.profile), args), args)
        shape = shape_of(args)
        extra = {}
        # not given: the tuner's own default rate stands
        if args.rollback_rate is not None:
            extra["rollback_rate"] = args.rollback_rate
        fixed = {**_parse_fix(args.fix), **step_order_change(args)}
        ordered = OffloadConfig().replace(**{k: v for k, v in fixed.items() if k == "step_order"})
        cons = plan.Constraints(
            **memory_caps(args), cpu_cores=args.cpu_cores, max_grad_norm=args.max_grad_norm,
            fixed=fixed, engine=engine_variant(args, ordered),
            allow_bf16_moments=args.allow_bf16_moments, storage=args.use_storage, **extra)
        cfg, why, pred = plan.tune(shape, prof, cons)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return fail(str(exc), args.json)
    if args.out is not None:
        try:
            args.out.write_text(json.dumps(cfg.to_dict(), indent=1, default=float))
        except OSError as exc:
            # checked at parse time; the folder may change meanwhile
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
        print(dp_line(shape, prof, [pred]))
    print()
    keys = ("bucket_bytes", "ratio", "speculation", "grad_cast", "param_cast", "weights",
            "cpu_cores_frac", "prefetch_depth", "optimizer_state_dtype", "step_order",
            "grad_accum_on", "max_grad_norm", "storage_path", "host_memory_budget_bytes",
            "weight_homes")
    print("OffloadConfig(" + ", ".join(f"{k}={getattr(cfg, k)!r}" for k in keys) + ")")
    print()
    print(results_table([pred]))
    return 0
