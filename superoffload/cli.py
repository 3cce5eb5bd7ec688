"""`python -m superoffload <command>`: train, bench, simulate, tune, capacity, plan (a Hugging
Face config), export (a checkpoint as a Hugging Face folder).

Each command lives in a module under `superoffload.commands` named after it, which exposes
`add_<command>_parser(subparsers)` (which sets `func` on its parser) so this file stays a
dispatcher; `capacity` shares `commands/simulate.py` (`add_capacity_parser`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from superoffload.process_env import claim_wait_policy

# (command module, its parser function), in the order `--help` lists the commands
COMMANDS = (("train", "add_train_parser"), ("bench", "add_bench_parser"),
            ("simulate", "add_simulate_parser"), ("tune", "add_tune_parser"),
            ("simulate", "add_capacity_parser"), ("plan", "add_plan_parser"),
            ("export", "add_export_parser"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m superoffload",
        description="SuperOffload: offload optimizer work to the CPU to train models larger "
        "than GPU memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, adder in COMMANDS:
        module = importlib.import_module(f"superoffload.commands.{name}")
        getattr(module, adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # the `superoffload` console script enters here, not through __main__.py: the CLI owns its
    # process, so it chooses the OpenMP wait policy before a command imports torch
    claim_wait_policy()
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
