"""Fail when a notebook in git carries outputs, execution counts or widget state, or cites one
of the team's design notes instead of a user doc (paths in notebooks are checked by
tests/test_architecture.py).

Run by `make lint`; `python scripts/check_notebooks.py --strip` cleans outputs in place (a
citation has to be fixed by hand: point at docs/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = ("notebooks", "tutorials")
DESIGN_NOTES = ("DESIGN.md", "FACTS.md")
"""The team's design notes (docs/DESIGN.md, docs/FACTS.md): a notebook cites the user doc of
its topic in docs/ instead."""


def dirty_reasons(nb: dict) -> list[str]:
    reasons = []
    if "widgets" in nb.get("metadata", {}):
        reasons.append("notebook metadata holds widget state")
    for i, cell in enumerate(nb.get("cells", [])):
        source = "".join(cell.get("source", []))
        for name in DESIGN_NOTES:
            if name in source:
                reasons.append(f"cell {i} cites {name}, a design note: "
                               "cite the docs/ page of its topic")
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            reasons.append(f"cell {i} has outputs")
        if cell.get("execution_count") is not None:
            reasons.append(f"cell {i} has an execution count")
    return reasons


def strip(nb: dict) -> dict:
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return nb


def main(argv: list[str]) -> int:
    fix = "--strip" in argv
    repo = Path(__file__).resolve().parent.parent
    bad = 0
    for root in ROOTS:
        for path in sorted((repo / root).glob("**/*.ipynb")):
            if ".ipynb_checkpoints" in path.parts:
                continue
            nb = json.loads(path.read_text())
            reasons = dirty_reasons(nb)
            if fix and any("cites" not in r for r in reasons):
                path.write_text(json.dumps(strip(nb), indent=1, ensure_ascii=False) + "\n")
                print(f"stripped {path.relative_to(repo)}")
                reasons = [r for r in reasons if "cites" in r]  # fixed by hand only
            if reasons:
                bad += 1
                print(f"{path.relative_to(repo)}: {'; '.join(reasons)}")
    if bad:
        print(f"{bad} notebook(s) to fix: `python scripts/check_notebooks.py --strip` "
              "removes outputs and widget state; a citation of a file outside the repository "
              "is fixed by hand")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
