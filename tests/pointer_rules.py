"""How the pointer checks of tests/test_architecture.py find pointers (docs/testing.md,
"Pointers that resolve"), over the files git knows (tracked, and untracked ones it does not
ignore):

* tracker numbers ("issue" followed by a number) in any text file or file name: a reader
  cannot open them;
* paths written in prose (comments and docstrings, Markdown outside code fences, C comments,
  notebook Markdown and code comments), and whether each names a file or folder that exists;
* pointers to a name in a Python file (``runtime/launch.py:Launcher.begin``,
  ``plan/buckets.plan_buckets``), and whether the file defines that name;
* citations of another project's files (``owner/project:path``, links into a code host);
* ``from superoffload.X import N`` that imports N through a module that does not define it
  (a package that lists N in ``__all__`` may offer it).

What each rule accepts is derived from the tree (its folders, files and modules), not from a
list kept by hand. Each finding is file:line and what was found.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = "tests/test_architecture.py"  # its examples of what is refused are data, not citations
PACKAGE = "superoffload"


@cache
def tree_files() -> tuple[str, ...]:
    """Tracked files and untracked ones git does not ignore, that exist, from the root."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # not a git checkout: walk it
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part in {"build", "dist", "__pycache__"}
                             for part in p.relative_to(ROOT).parts)]
    return tuple(sorted(n for n in set(names) if (ROOT / n).is_file()))


@cache
def text_of(path: str) -> str | None:
    """The file's text, or None for a binary file."""
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ------------------------------------------------------------------ tracker numbers
TRACKER_WORD = "iss" + "ue"  # spelled in two parts so this file does not match itself
TRACKER = re.compile(rf"\b{TRACKER_WORD}s?[ _-]?#?\d+(?![\dx])", re.IGNORECASE)


def tracker_numbers() -> list[str]:
    bad = []
    for path in tree_files():
        if TRACKER.search(path):
            bad.append(f"{path}: the file name")
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if m := TRACKER.search(line):
                bad.append(f"{path}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return bad


# ------------------------------------------------------------------ paths in prose
# A path: folders and a file with an extension, or a bare file name of ours. Not preceded by
# a word character, ".", "/", ":" (project:path, URLs) or "<" (a <placeholder>), nor followed
# by a word character, "/" or ">".
PATH = re.compile(r"(?<![\w./:<>-])((?:[\w.-]+/)+[\w-]+(?:\.\w+)+|[\w-]+\.(?:py|md|ipynb))"
                  r"(?![\w/>])")


@cache
def _parsed(text: str) -> ast.Module | None:
    """The syntax tree of Python source (each file is parsed once for all three checks)."""
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, nested ones too (expressions are not walked: prose and imports are
    statements)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _statements(handler.body)
        for case in getattr(node, "cases", []):
            yield from _statements(case.body)


def _python_prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of a Python file's comments and string statements (docstrings)."""
    tree = _parsed(text)
    if tree is None:
        return
    for node in _statements(tree.body):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for k, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + k, line
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
    except (tokenize.TokenError, SyntaxError):
        return


def _markdown_prose(lines: list[str], first: int = 1) -> Iterator[tuple[int, str]]:
    fenced = False
    for n, line in enumerate(lines, first):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield n, line


def prose(path: str, text: str) -> Iterator[tuple[str, str]]:
    """(where, text) of every line of prose in a file; where is "line" or "cell N, line M"."""
    if path.endswith(".py"):
        for n, line in _python_prose(text):
            yield str(n), line
    elif path.endswith(".md"):
        for n, line in _markdown_prose(text.splitlines()):
            yield str(n), line
    elif path.endswith((".c", ".h")):
        for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S):
            start = text.count("\n", 0, m.start()) + 1
            for k, line in enumerate(m.group(0).splitlines()):
                yield str(start + k), line
    elif path.endswith(".ipynb"):
        for c, cell in enumerate(json.loads(text).get("cells", []), 1):
            source = cell.get("source", [])
            text = "".join(source) if isinstance(source, list) else source
            lines = text.splitlines()
            if cell.get("cell_type") == "markdown":
                found = _markdown_prose(lines)
            elif cell.get("cell_type") == "code":  # magics and shell lines are not Python
                found = _python_prose("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln
                                                for ln in lines))
            else:
                continue
            for n, line in found:
                yield f"cell {c}, line {n}", line


@cache
def _dir_names() -> frozenset[str]:
    return frozenset(part for f in tree_files() for part in Path(f).parts[:-1])


@cache
def _basenames() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in tree_files():
        out.setdefault(Path(f).name, []).append(f)
    return out


def _exists(candidate: str) -> bool:
    norm = os.path.normpath(candidate)
    return not norm.startswith("..") and (ROOT / norm).exists()


SOURCE = frozenset({"py", "pyi", "c", "h", "cpp", "cu", "md", "ipynb"})
"""Extensions of source and docs: such a file outside the tree is another project's."""


def resolves(ref: str, src: str) -> bool:
    """Whether a path written in ``src``'s prose names something in this tree. Written from
    the root, from superoffload/, or from the file's own folder; a bare name may name a
    sibling or a file whose name is unique in the tree; a ``.md`` name a doc in docs/.
    Another project's source file is written project:path, which the pattern skips."""
    here = str(Path(src).parent)
    bases = ("", f"{PACKAGE}/", f"{here}/")
    if "/" in ref:
        if ref.split("/", 1)[0] not in _dir_names():
            # not a folder of this tree: an output (runs/..., OUT/x.pt), a model id, a media
            # type; a source file there is another project's, or a folder that was removed
            return ref.rsplit(".", 1)[-1] not in SOURCE
        if any(_exists(base + ref) for base in bases):
            return True
        head = ref  # module/path.attribute: some prefix ending at a dot is a module
        while "." in head.rsplit("/", 1)[-1]:
            head = head.rsplit(".", 1)[0]
            if any(_exists(base + head + ".py") for base in bases):
                return True
        return False
    if ref.endswith(".md") and (_exists(ref) or _exists(f"docs/{ref}")):
        return True
    return _exists(f"{here}/{ref}") or len(_basenames().get(ref, [])) == 1


def unresolved_paths() -> list[str]:
    bad = []
    for path in tree_files():
        if not path.endswith((".py", ".md", ".c", ".h", ".ipynb")):
            continue
        text = text_of(path)
        if text is None:
            continue
        seen = set()
        for where, line in prose(path, text):
            for m in PATH.finditer(line):
                ref = m.group(1).rstrip(".")
                if (where, ref) not in seen and not resolves(ref, path):
                    seen.add((where, ref))
                    bad.append(f"{path}:{where}: {ref}")
    return bad


# ------------------------------------------------------------------ citations
# Another project's file cited as owner/project:path, or a link into a code host: a reader of
# this repository cannot follow it and it goes stale when the other project moves.
CITATION = re.compile(r"(?<![\w./-])(?:[\w.-]+/[\w.-]+:(?:[\w.-]+/)+[\w.-]+"
                      r"\.(?:py|pyi|c|h|cpp|cu|md)\b"
                      r"|(?:https?://)?(?:www\.)?github\.com/\S+)")


def outside_citations() -> list[str]:
    bad = []
    for path in tree_files():
        if not path.endswith((".py", ".md", ".c", ".h", ".ipynb")) or path == THIS:
            continue
        text = text_of(path)
        if text is None:
            continue
        for where, line in prose(path, text):
            bad += [f"{path}:{where}: {m.group(0)}" for m in CITATION.finditer(line)]
    return bad


# ------------------------------------------------------------------ imports
def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def package_modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    return {_module_name(f): f for f in tree_files()
            if f.startswith(f"{PACKAGE}/") and f.endswith(".py")}


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import, inside if/try blocks too."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import`` in ``module``."""
    if not node.level:
        return node.module or ""
    is_package = package_modules()[module].endswith("__init__.py")
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def bindings(
        module: str) -> tuple[frozenset[str], dict[str, tuple[str, str | None]], frozenset[str]]:
    """(names the module defines, names it imports -> (module, name), its ``__all__``)."""
    tree = ast.parse((ROOT / package_modules()[module]).read_text(encoding="utf-8"))
    defined: set[str] = set()
    imported: dict[str, tuple[str, str | None]] = {}
    exported: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                defined.update(x.id for x in ast.walk(target) if isinstance(x, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__all__" and node.value:
                    exported.update(c.value for c in ast.walk(node.value)
                                    if isinstance(c, ast.Constant) and isinstance(c.value, str))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for alias in node.names:
                imported[alias.asname or alias.name] = (base, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    return frozenset(defined), imported, frozenset(exported)


def origin(module: str, name: str, depth: int = 0) -> str | None:
    """The module that defines ``name`` as seen from ``module`` (following its imports)."""
    defined, imported, _ = bindings(module)
    if name in defined or f"{module}.{name}" in package_modules():
        return module
    if name in imported and depth < 20:
        base, original = imported[name]
        if original is None or base not in package_modules():
            return base
        return origin(base, original, depth + 1)
    return None


def _python_sources() -> Iterator[tuple[str, str, str | None]]:
    """(path, source, module name if it is a package module) of the Python that imports ours:
    the package, tests, benchmarks, scripts, and the notebooks' code cells."""
    for path in tree_files():
        text = text_of(path) if path.endswith((".py", ".ipynb")) else None
        if text is None:
            continue
        if path.endswith(".py"):
            yield path, text, _module_name(path) if path.startswith(f"{PACKAGE}/") else None
            continue
        for c, cell in enumerate(json.loads(text).get("cells", []), 1):
            if cell.get("cell_type") == "code":
                source = cell.get("source", [])
                lines = ("".join(source) if isinstance(source, list) else source).splitlines()
                yield f"{path} cell {c}", "\n".join(
                    "" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines), None


def indirect_imports() -> list[str]:
    modules = package_modules()
    bad = []
    for path, text, module in _python_sources():
        tree = _parsed(text)
        if tree is None:
            continue
        for node in _statements(tree.body):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(module, node) if module and node.level else (node.module or "")
            if source not in modules:
                continue
            exported = bindings(source)[2] if modules[source].endswith("__init__.py") else set()
            for alias in node.names:
                name = alias.name
                if f"{source}.{name}" in modules or name in exported:
                    continue
                home = origin(source, name)
                if home is not None and home != source:
                    bad.append(f"{path}:{node.lineno}: {name} via {source}; defined in {home}")
    return bad


# ------------------------------------------------------------------ names in pointers
# A pointer to a name in a Python file: `runtime/launch.py:Launcher.begin` (the file, a colon,
# the name) or `plan/buckets.plan_buckets` (the module's path, a dot, the name). The name is
# a top-level name of the file (a def, a class, an assignment), or a class's member after a
# dot (a method, a class attribute or field, an attribute its methods set on self).
NAMED = re.compile(r"(?<![\w./:<>-])((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _member_names(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and what its methods set on self."""
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    return out


@cache
def names_in(path: str) -> dict[str, frozenset[str]]:
    """A Python file's top-level names -> the member names of each (empty but for classes)."""
    tree = _parsed(text_of(path) or "")
    out: dict[str, frozenset[str]] = {}
    for node in _top_level(tree.body if tree is not None else []):
        if isinstance(node, ast.ClassDef):
            out[node.name] = frozenset(_member_names(node))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = frozenset()
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({x.id: frozenset() for t in targets for x in ast.walk(t)
                        if isinstance(x, ast.Name)})
    return out


def has_name(path: str, name: str) -> bool:
    """Whether ``name`` (``f`` or ``Class.member``) is defined in the Python file ``path``."""
    head, _, member = name.partition(".")
    found = names_in(path)
    if head not in found:
        return False
    return not member or member.partition(".")[0] in found[head]


def _python_file(ref: str, src: str) -> str | None:
    """The tree's Python file a pointer's path names, as `resolves` finds it (None: none)."""
    here = str(Path(src).parent)
    for base in ("", f"{PACKAGE}/", f"{here}/"):
        norm = os.path.normpath(base + ref)
        if not norm.startswith("..") and (ROOT / norm).is_file():
            return norm
    named = _basenames().get(Path(ref).name, [])
    return named[0] if "/" not in ref and len(named) == 1 else None


def named_pointers(path: str, line: str) -> Iterator[tuple[str, str, str]]:
    """(what was written, the Python file, the name) for each pointer to a name in ``line``."""
    for m in NAMED.finditer(line):
        file = _python_file(m.group(1), path)
        if file is not None:
            yield m.group(0), file, m.group(2).rstrip(".")
    for m in PATH.finditer(line):
        ref = m.group(1).rstrip(".")
        if "/" not in ref or _python_file(ref, path) is not None:
            continue
        head, name = ref, ""  # module/path.name: the longest prefix that is a module
        while "." in head.rsplit("/", 1)[-1]:
            head, _, last = head.rpartition(".")
            name = f"{last}.{name}" if name else last
            file = _python_file(head + ".py", path)
            if file is not None:
                yield ref, file, name
                break


def unresolved_names() -> list[str]:
    bad = []
    for path in tree_files():
        if not path.endswith((".py", ".md", ".c", ".h", ".ipynb")):
            continue
        text = text_of(path)
        if text is None:
            continue
        for where, line in prose(path, text):
            bad += [f"{path}:{where}: {written} ({file} has no {name!r})"
                    for written, file, name in named_pointers(path, line)
                    if not has_name(file, name)]
    return bad


# ------------------------------------------------------------------ the rules themselves
