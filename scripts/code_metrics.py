"""How the code reads, counted: own-line comments and docstring lines per 1,000 code lines,
conditional expressions (``a if c else b``) per 1,000 code lines, and lines over the length
ruff enforces -- the figures the style guide states (docs/conventions.md,
"Comments say why and cite the paper").

    python scripts/code_metrics.py                 # superoffload/, as a table
    python scripts/code_metrics.py superoffload/runtime superoffload/plan --json

"Code lines": non-blank lines that are neither comments nor docstring lines.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE_LENGTH = 100
"""pyproject.toml's ``[tool.ruff] line-length``."""


@dataclass
class Counts:
    files: int = 0
    code_lines: int = 0
    comment_lines: int = 0
    docstring_lines: int = 0
    conditional_expressions: int = 0
    long_lines: int = 0

    def per_1000(self, n: int) -> float:
        return 1000.0 * n / max(1, self.code_lines)


def count(path: Path, into: Counts) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
        if isinstance(node, ast.IfExp):
            into.conditional_expressions += 1
    comment_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                     if tok.type == tokenize.COMMENT and not tok.line[:tok.start[1]].strip()}
    for k, line in enumerate(text.splitlines(), start=1):
        if len(line) > LINE_LENGTH:
            into.long_lines += 1
        if not line.strip() or k in doc_lines or k in comment_lines:
            continue
        into.code_lines += 1
    into.comment_lines += len(comment_lines)
    into.docstring_lines += len(doc_lines)
    into.files += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[str(ROOT / "superoffload")])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    c = Counts()
    for p in args.paths:
        for f in sorted(Path(p).rglob("*.py")) if Path(p).is_dir() else [Path(p)]:
            count(f, c)
    row = {**asdict(c), "comments_per_1000": round(c.per_1000(c.comment_lines), 1),
           "docstring_lines_per_1000": round(c.per_1000(c.docstring_lines), 1),
           "conditional_expressions_per_1000": round(c.per_1000(c.conditional_expressions), 1)}
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:34s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
