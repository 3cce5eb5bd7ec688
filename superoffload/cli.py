"""`python -m superoffload <command>`: train, bench, simulate, tune, plan (a Hugging Face config).

Each command lives in its own module under `superoffload.commands` and exposes
`add_parser(subparsers)` (which sets `func` on its parser) so this file stays a dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command module names, in the order `--help` lists them
COMMANDS = ("train", "bench", "plan", "fit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m superoffload",
        description="SuperOffload: offload optimizer work to the CPU to train models larger "
        "than GPU memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"superoffload.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
