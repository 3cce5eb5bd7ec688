"""What the planner's commands (`simulate`, `tune`, `capacity`, `plan`) share: the model-shape
and engine flags, the hardware profile a flag names, the results table, and how a command
fails (exit code 2, the reason on stderr or as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from superoffload.config import OffloadConfig, choices_of
from superoffload.plan.schedule import TAIL_STEPS
from superoffload.plan.storage_presets import STORAGE_NAMES

SHAPE_DEFAULTS = {"layers": 40, "hidden": 5120, "heads": 40, "vocab": 50257}
"""The GPT the shape flags describe when not given (a 12.8B GPT-3-like model)."""

MODEL_DTYPES = dict(zip(choices_of("precision", decided=True), ("float32", "bfloat16", "float16"),
                        strict=True))
"""``--dtype`` (the config's spelling, ``OffloadConfig.precision`` without "auto") -> the
planner's ``ModelShape.dtype`` (torch's name)."""


def dtype_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--dtype`` in the config's spelling (``OffloadConfig.precision``)."""
    p.add_argument("--dtype", choices=tuple(MODEL_DTYPES), help=help)


def model_dtype(args: argparse.Namespace) -> dict[str, str]:
    """The ``ModelShape`` change ``--dtype`` asks for (none when it is not given)."""
    return {"dtype": MODEL_DTYPES[args.dtype]} if getattr(args, "dtype", None) else {}


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-order", choices=choices_of("step_order"),
                   help="OffloadConfig.step_order: 'deadline' (earliest deadline first; the "
                        "default) or 'fifo' (gradient-ready order)")
    p.add_argument("--tail-step", choices=TAIL_STEPS,
                   help="what-if engine variant: the GPU tail step (default: the engine's, "
                        "fused)")


def step_order_change(args: argparse.Namespace) -> dict[str, str]:
    """The OffloadConfig change --step-order asks for (none when it is not given)."""
    return {} if args.step_order is None else {"step_order": args.step_order}


def engine_variant(args: argparse.Namespace, cfg: OffloadConfig) -> Any:
    """The EngineVariant --tail-step asks for, with the step order ``cfg`` selects (as the
    engine resolves it, plan.schedule.engine_for); None without the flag (the engine's)."""
    from dataclasses import replace

    from superoffload.plan.schedule import engine_for

    if args.tail_step is None:
        return None
    return replace(engine_for(cfg), tail_step=args.tail_step)


def machine_args(p: argparse.ArgumentParser) -> None:
    """The flags that change the profile's host share and storage tier."""
    p.add_argument("--gpus-per-host", type=int, metavar="N",
                   help="GPUs whose jobs share the host (its memory, cores and drives): one "
                        "GPU gets 1/N of them; the profile says how many (8 on the *-sxm "
                        "servers); 1: this job has the whole host")
    p.add_argument("--storage", metavar="TIER",
                   help="the storage tier: " + ", ".join(STORAGE_NAMES) + ", 'none', or "
                        "measure:FOLDER (measured with the project's I/O engine); default: "
                        "the profile's")


def with_machine(prof: Any, args: argparse.Namespace) -> Any:
    """``prof`` with ``--gpus-per-host`` and ``--storage`` applied."""
    from superoffload.plan import storage_presets

    if getattr(args, "gpus_per_host", None) is not None:
        if args.gpus_per_host < 1:
            raise ValueError(f"--gpus-per-host {args.gpus_per_host}: use a whole number >= 1")
        prof = prof.replace(gpus_per_host=args.gpus_per_host, sources=tuple(
            (k, v) for k, v in prof.sources if k != "gpus_per_host") + (
            ("gpus_per_host", "spec: given on the command line (--gpus-per-host)"),))
    tier = getattr(args, "storage", None)
    if tier:
        if tier.startswith("measure:"):
            from superoffload.plan.measure_storage import measure_storage_tier

            fields = measure_storage_tier(tier[len("measure:"):])
        else:
            fields = storage_presets.by_name(tier)
        prof = storage_presets.with_tier(prof, fields)
    return prof


def shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="gh200",
                   help="preset name (gh200, gb200, mi300a, h100-pcie, h200-pcie, cpu-laptop, "
                        "h200-pcie-measured), 'local' (measure this machine), or a profile "
                        "JSON file")
    machine_args(p)
    p.add_argument("--layers", type=int,
                   help=f"transformer blocks (default {SHAPE_DEFAULTS['layers']})")
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
    from superoffload.jsonfile import parse_object

    if name == "local":
        return plan.measure_local()
    path = Path(name)
    if path.suffix == ".json" and path.exists():
        return plan.HardwareProfile.from_dict(parse_object(
            path.read_text(), f"profile {path}",
            hint="; write one with plan.measure_local() or HardwareProfile.to_dict()"))
    return plan.profiles.get(name)


def shape_of(args: argparse.Namespace) -> Any:
    """The ModelShape the shape flags (or ``--hf-config``) describe."""
    from superoffload import plan

    common: dict[str, Any] = dict(seq=args.seq, micro_batch=args.micro_batch,
                  activation_checkpointing=not args.no_checkpointing, dp=args.dp,
                  ranks_per_host=args.ranks_per_host)
    if getattr(args, "hf_config", None):
        given = [f"--{k}" for k in SHAPE_DEFAULTS if getattr(args, k) is not None]
        if given:
            raise ValueError(f"--hf-config describes the model: drop {', '.join(given)}")
        return plan.ModelShape.from_hf_config(args.hf_config, **common, **model_dtype(args))
    if getattr(args, "dtype", None):
        raise ValueError("--dtype applies to --hf-config only")
    dims: dict[str, Any] = {k: v if (v := getattr(args, k)) is not None else d
                            for k, d in SHAPE_DEFAULTS.items()}
    return plan.ModelShape(**dims, **common)


def memory_caps(args: argparse.Namespace) -> dict[str, Any]:
    """``--device-gb`` / ``--host-gb`` as ``plan.Constraints``' byte caps."""
    caps: dict[str, Any] = {}
    # a flag not given leaves the cap out: Constraints' default (None) means the profile's
    for flag, key in (("device_gb", "device_memory_bytes"), ("host_gb", "host_memory_bytes")):
        if (gb := getattr(args, flag)) is not None:
            caps[key] = gb * 1e9
    return caps


def with_collective(prof: Any, args: argparse.Namespace) -> Any:
    if args.collective_gbps is None:
        return prof
    return prof.replace(collective_gbps=args.collective_gbps)


def fail(msg: str, as_json: bool = False) -> int:
    """Exit code 2 with the reason: on stderr, or as {"error": ...} on stdout with --json (a
    script reading the output gets JSON either way)."""
    if as_json:
        print(json.dumps({"error": msg}))
    else:
        print(f"error: {msg}", file=sys.stderr)
    return 2


def results_table(results: list[Any]) -> str:
    from superoffload.telemetry.events import LANES

    lanes = " ".join(f"{lane[:10]:>10}" for lane in LANES)
    head = (f"{'system':13} {'iter ms':>9} {'TFLOPS':>7} {lanes} {'device GB':>9} "
            f"{'host GB':>8}  fits")
    lines = [head, "-" * len(head)]
    for r in results:
        util = " ".join(f"{r.lanes[lane].utilization:>10.0%}" for lane in LANES)
        fits = "yes"
        # a system that does not fit says why, in the same cell
        if not r.fits:
            fits = "NO: " + "; ".join(r.problems)
        lines.append(f"{r.plan.system:13} {r.iteration_s * 1e3:9.1f} {r.tflops:7.0f} {util} "
                     f"{r.memory['device'] / 1e9:9.1f} {r.memory['host'] / 1e9:8.1f}  {fits}")
    lines.append("(lane columns: busy share of one steady-state iteration)")
    return "\n".join(lines)


def dp_line(shape: Any, prof: Any, results: list[Any]) -> str:
    coll = ", ".join(f"{r.plan.system} {r.collective_s * 1e3:.1f} ms" for r in results)
    return (f"data parallel: {shape.dp} ranks, {shape.ranks_per_host} per host, collectives at "
            f"{prof.collective_gbps:g} GB/s per rank; figures below are per rank "
            f"(collective time per iteration: {coll})")
