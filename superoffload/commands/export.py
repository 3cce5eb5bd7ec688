"""`python -m superoffload export SOURCE OUT`: a run's fp32 masters as a Hugging Face folder.

    python -m superoffload export runs/a/checkpoint out/model                 # fp32, exact
    python -m superoffload export runs/a/checkpoints/step-000040 out/model --dtype bf16
    python -m superoffload export hf_out/checkpoint-200 out/model --max-shard-size 2GB
    python -m superoffload export ckpt out/model --config path/to/base_model  # its config.json

SOURCE is a checkpoint folder: ``engine.save_checkpoint``'s (engine.pt), an FSDP2 checkpoint
written under torchrun (manifest.json), or a ``SuperOffloadTrainer`` ``checkpoint-N``. OUT
must not exist (or be empty); it receives model.safetensors (or shards and their index),
config.json when the model's config is known (``--config`` gives it) and the tokenizer files
of a Trainer checkpoint; a peft run gives its adapter. Memory holds one tensor at a time.
docs/export.md says more; ``superoffload.export_hf`` is the same in Python.
"""

from __future__ import annotations

import argparse
import json
import sys

from superoffload.commands.planner_args import fail
from superoffload.export.shards import DEFAULT_MAX_SHARD, parse_size


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint's fp32 masters as a Hugging Face folder",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="checkpoint folder (engine.save_checkpoint, FSDP2, or a Trainer "
                        "checkpoint-N)")
    p.add_argument("out", metavar="OUT", help="folder to create (must not exist, or be empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the floating-point tensors (default fp32: the masters bit "
                        "for bit; bf16 rounds each master once)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, metavar="SIZE",
                   help=f"largest weights file, e.g. 5GB, 500MB, 2GiB (default "
                        f"{DEFAULT_MAX_SHARD}); a larger model is sharded with "
                        "model.safetensors.index.json")
    p.add_argument("--config", metavar="PATH",
                   help="config.json, or the base model's folder (its config and tokenizer "
                        "files), when the checkpoint does not say which model it is")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        return fail(f"--max-shard-size: {exc}", args.json)
    from superoffload.export.writer import export_hf

    try:
        report = export_hf(args.source, args.out, dtype=args.dtype,
                           max_shard_bytes=max_shard_bytes, config=args.config)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        # a folder that is no checkpoint, a damaged or foreign one, OUT taken, a full disk:
        # the message names what was found and what to do; nothing was left at OUT
        return fail(str(exc), args.json)
    if args.json:
        print(json.dumps({"out_dir": report.out_dir, "source": report.source,
                          "dtype": report.dtype, "files": list(report.files),
                          "index_file": report.index_file, "tensors": report.tensors,
                          "total_bytes": report.total_bytes, "config_from": report.config_from,
                          "peak_held_bytes": report.peak_held_bytes}))
    else:
        print("\n".join(report.lines()), file=sys.stdout, flush=True)
    return 0
