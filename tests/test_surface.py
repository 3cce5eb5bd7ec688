"""The user-visible surface is frozen: a change to it is deliberate.

``tests/fixtures/surface.json`` holds, derived from the code (not typed by hand): every
``OffloadConfig`` field (type, default, roles, declared bound, choices), every command-line
command with each flag (option strings, destination, choices, default, type, nargs), and the
DeepSpeed keys ``from_deepspeed`` reads. A renamed flag, a removed choice or a changed
default fails here. If the change is deliberate, regenerate the snapshot and say in
CHANGELOG.md what changed and what to use instead:

    .venv/bin/python tests/test_surface.py --write
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import Any, get_type_hints

SNAPSHOT = Path(__file__).parent / "fixtures" / "surface.json"


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return getattr(value, "__name__", repr(value))


def surface() -> dict[str, Any]:
    from superoffload import cli, ds_config
    from superoffload.config import CHOICES, OffloadConfig

    hints = get_type_hints(OffloadConfig)
    fields = {}
    for f in dataclasses.fields(OffloadConfig):
        bound = f.metadata["bound"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        fields[f.name] = {
            "type": str(hints[f.name]).replace("typing.", ""), "default": _plain(default),
            "numerics": f.metadata["numerics"], "live": f.metadata["live"],
            "tuned": f.metadata["tuned"], "choices": _plain(CHOICES.get(f.name)),
            "bound": {k: _plain(getattr(bound, k)) for k in ("kind", "lo", "lo_open", "hi",
                                                               "none_ok") },
        }
    commands: dict[str, Any] = {}
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        flags = []
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags.append({
                "options": list(action.option_strings) or [action.dest], "dest": action.dest,
                "choices": _plain(list(action.choices)) if action.choices else None,
                "default": _plain(action.default), "type": _plain(action.type),
                "nargs": _plain(action.nargs), "action": type(action).__name__})
        commands[name] = flags
    keys = {section: sorted(names) for section, names in ds_config.ACCEPTED_KEYS.items()}
    return {"config": fields, "commands": commands, "deepspeed_keys": keys}


def test_the_user_visible_surface_is_the_snapshot() -> None:
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(surface()))
    if got != want:
        diff = "\n".join(difflib.unified_diff(
            json.dumps(want, indent=1, sort_keys=True).splitlines(),
            json.dumps(got, indent=1, sort_keys=True).splitlines(), "snapshot", "code",
            lineterm="", n=2))
        raise AssertionError(
            "the user-visible surface changed (config fields, command-line flags or DeepSpeed "
            "keys): if deliberate, regenerate the snapshot with `python tests/test_surface.py "
            "--write` and say in CHANGELOG.md what changed and what to use instead"
            f"\n{diff}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_surface.py --write")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    old = SNAPSHOT.read_text() if SNAPSHOT.exists() else "{}"
    new = json.dumps(surface(), indent=1, sort_keys=True) + "\n"
    SNAPSHOT.write_text(new)
    print("\n".join(difflib.unified_diff(old.splitlines(), new.splitlines(), "old", "new",
                                         lineterm="")) or "unchanged")
