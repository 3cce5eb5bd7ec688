"""`python -m superoffload train` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train (not built yet)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise SystemExit("superoffload train is not built yet")
