"""docs/failure_semantics.md's "What you may do with the engine" is checked, row by row.

Every pattern of torch's optimizer contract has a row (edit gradients, write weights, save
mid-iteration, add a param group, two engines, compile, mismatched ranks, heavy clipping),
every row names at least one test, and every test it names exists in tests/ (a renamed or
deleted test makes this fail, so the table cannot drift from what is checked).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "failure_semantics.md"
REQUIRED = ("Heavy clipping", "Edit gradients", "engine.clip_grad_norm_", "Change gradients",
            "model.load_state_dict", "Write weights in place", "right after `step()`",
            "Replace a parameter's storage", "Read weights", "between `backward()` and `step()`",
            "add_param_group", "second `so.initialize`", "torch.compile", "Data-parallel ranks",
            "Pickle")


def rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text.split("## What you may do with the engine", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| pattern") and "---" not in line:
            out.append([c.strip() for c in line.strip("|").split(" | ")])
    return out


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_every_required_pattern_has_a_row():
    patterns = [r[0] for r in rows()]
    for want in REQUIRED:
        assert any(want in p for p in patterns), want


def test_every_row_names_tests_that_exist():
    have = defined_tests()
    table = rows()
    assert len(table) >= len(REQUIRED)
    for pattern, behaviour, tests in table:
        named = re.findall(r"test_[A-Za-z0-9_]+", tests)
        assert named, f"row without a test: {pattern}"
        missing = [n for n in named if n not in have]
        assert not missing, f"{pattern}: no such test {missing}"
        # each row says which way it goes: done as torch does, or refused naming the way
        assert behaviour.startswith(("honoured", "refused", "the first", "`model.state_dict()`",
                                     "see")), behaviour
