"""Regenerate superoffload/data/corpus.txt.gz: the main job's embedded training text.

The corpus is the documentation strings of the Python standard library (modules, classes,
functions), read with `ast` from the source files every Python install has. They are English
prose with code mixed in: enough structure for a byte-level model to learn visibly within a
few hundred steps. Licence: Python Software Foundation License (see corpus_LICENSE.txt).

The committed file was made with CPython 3.11; another Python version gives a slightly
different (equally usable) text. The output is deterministic for a given Python:
modules in sorted order, gzip with mtime=0.

    python scripts/make_corpus.py [--max-bytes 1500000] [--out superoffload/data/corpus.txt.gz]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import inspect
import sys
import sysconfig
from pathlib import Path

# Skipped: tests (huge, repetitive), vendored and generated modules, private ones.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "ensurepip", "pydoc_data", "turtledemo", "__pycache__", "encodings"}


def docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError):
        return []
    out: list[str] = []
    nodes: list[ast.AST] = [tree]
    nodes += [n for n in ast.walk(tree)
              if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if not doc or len(doc) < 40:
            continue  # one-liners like "Return self." teach little
        name = getattr(node, "name", None)
        header = f"{name}:\n" if name else ""
        out.append(header + inspect.cleandoc(doc))
    return out


def build(max_bytes: int) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not SKIP_PARTS & set(p.relative_to(stdlib).parts)
                   and not p.name.startswith("_"))
    chunks: list[bytes] = []
    total = 0
    for path in files:
        texts = docstrings(path)
        if not texts:
            continue
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts)
        body = f"# {module}\n\n" + "\n\n".join(texts) + "\n\n"
        data = body.encode("utf-8")
        # keep the corpus to (mostly) ASCII bytes so 256 byte values cover it densely
        data = data.decode("utf-8").encode("ascii", errors="replace")
        if total + len(data) > max_bytes:
            break
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=1_500_000)
    repo = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=repo / "superoffload/data/corpus.txt.gz")
    args = parser.parse_args()
    text = build(args.max_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                    compresslevel=9, filename="") as gz:
        gz.write(text)
    print(f"python {sys.version.split()[0]}: {len(text):,} bytes of text -> "
          f"{args.out.stat().st_size:,} bytes gzip at {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
