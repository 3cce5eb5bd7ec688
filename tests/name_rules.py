"""How tests/test_architecture.py finds a word that means two things in the package
(docs/conventions.md, "Names carry units and placement": one word means one thing):

* a public top-level name (a ``def``, a ``class`` or an assignment at module level, not
  ``_private``) defined by two modules with different definitions;
* a module file name (``weights.py``) in two folders.

What counts as "one meaning" is read from the code, not from a list kept by hand:

* the same definition (the same syntax tree, docstrings aside) is one meaning, wherever it is;
* a re-export is no definition: an import (what a package's ``__init__`` does), or an
  assignment of another module's same-named object (``MANIFEST = legacy.MANIFEST``);
* a function that calls another module's function of the same name is that function at
  another layer (``hf_config.shape_fields`` reads the file, then calls ``hf_meta``'s);
* modules that implement one ``typing.Protocol`` of the package share its members' names: a
  module implements a protocol when the protocol's docstring names the module's file and the
  module defines every member at top level (the kernel backends: kernels/prepared.py
  ``Backend``, "what kernels/cpu_adam.py and kernels/torch_ref.py provide").

The only file name several folders may use is a package's ``__init__``: Python names its own
module so; every other module is named after what it holds, so a reader who meets a module's
name (``from superoffload.runtime import engine_state``) knows which file that is.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "superoffload"
PACKAGE_FILE = "__init__.py"
"""The one file name several folders may use: a package's own module (the language names it)."""


def package_sources() -> dict[str, str]:
    """Dotted module name -> source, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text(encoding="utf-8")
    return out


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import, inside if/try blocks too."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _top_level(block)


def _public(name: str) -> bool:
    return not name.startswith("_")


def _without_docstrings(node: ast.AST) -> str:
    """The definition's syntax tree as text, docstrings left out (they may differ in words)."""
    node = ast.parse(ast.unparse(node)).body[0]  # a copy, without positions
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            n.body = body[1:] or [ast.Pass()]
    return ast.dump(node)


def _imported(tree: ast.Module) -> dict[str, str]:
    """Local name -> the name it had where it came from, for the module's imports."""
    out = {}
    for node in _top_level(tree.body):
        if isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name for a in node.names})
    return out


def _is_reexport(name: str, value: ast.expr | None, imported: Mapping[str, str]) -> bool:
    """``name = other_module.name``, or ``name = imported`` of an object imported as ``name``."""
    if isinstance(value, ast.Attribute):
        return value.attr == name
    return isinstance(value, ast.Name) and imported.get(value.id) == name


def definitions(tree: ast.Module) -> dict[str, str]:
    """Public top-level name -> its definition as text; re-exports left out."""
    imported = _imported(tree)
    out: dict[str, str] = {}
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if _public(node.name):
                out[node.name] = _without_docstrings(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            text = ast.dump(node.value) if node.value else ast.dump(node)
            for target in targets:
                if isinstance(target, ast.Name) and _public(target.id) \
                        and not _is_reexport(target.id, node.value, imported):
                    out[target.id] = text
                elif isinstance(target, ast.Tuple):  # a, b = f(): each the value's k-th
                    out.update({t.id: f"{text}[{k}]" for k, t in enumerate(target.elts)
                                if isinstance(t, ast.Name) and _public(t.id)})
    return {n: d for n, d in out.items() if not (n.startswith("__") and n.endswith("__"))}


def _is_protocol(node: ast.ClassDef) -> bool:
    for base in node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        if (isinstance(base, ast.Name) and base.id == "Protocol") or \
                (isinstance(base, ast.Attribute) and base.attr == "Protocol"):
            return True
    return False


def protocols(trees: Mapping[str, ast.Module]) -> dict[str, tuple[frozenset[str], str]]:
    """``module:Class`` -> (public member names, docstring), for every ``typing.Protocol`` of
    the package."""
    out = {}
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and _is_protocol(node):
                members = {n.name for n in node.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                members |= {n.target.id for n in node.body
                            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                members = {m for m in members if _public(m)}
                if members:
                    out[f"{module}:{node.name}"] = (frozenset(members),
                                                    ast.get_docstring(node) or "")
    return out


def _named_in(module: str, doc: str) -> bool:
    """``doc`` names the module's file as prose does (``kernels/cpu_adam.py``, from
    superoffload/; a package's ``kernels/__init__.py``)."""
    path = "/".join(module.split(".")[1:])
    return f"{path}.py" in doc or f"{path}/{PACKAGE_FILE}" in doc


def _bound(body: list[ast.stmt], modules: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """Local name -> ("module", M) for a package module, ("name", M.N) for a name imported from
    one, by the imports among ``body``'s statements (nested ones too)."""
    out: dict[str, tuple[str, str]] = {}
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out[a.asname or a.name] = ("module", full) if full in modules else ("name", full)
        elif isinstance(node, ast.Import):
            out.update({a.asname: ("module", a.name) for a in node.names
                        if a.asname and a.name in modules})
    return out


def _delegates_to(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: Mapping[str, tuple[str, str]],
                  modules: Mapping[str, object]) -> set[str]:
    """The modules whose function named like ``fn`` it calls (``hf_meta.shape_fields(...)``, or
    ``of_module(...)`` imported as ``from module_shape import shape_fields as of_module``)."""
    local = {**bound, **_bound(fn.body, modules)}
    out = set()
    for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == fn.name and isinstance(f.value, ast.Name) \
                and local.get(f.value.id, ("", ""))[0] == "module":
            out.add(local[f.value.id][1])
        elif isinstance(f, ast.Name) and local.get(f.id, ("", ""))[0] == "name":
            home, _, original = local[f.id][1].rpartition(".")
            if original == fn.name:
                out.add(home)
    return out


def meanings(sources: Mapping[str, str]) -> dict[str, dict[str, list[str]]]:
    """Public name -> {one meaning -> the modules that define the name with it}."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    defined = {m: definitions(t) for m, t in trees.items()}
    interfaces = protocols(trees)
    key: dict[tuple[str, str], str] = {}
    for module, names in defined.items():
        implemented = [(p, members) for p, (members, doc) in sorted(interfaces.items())
                       if _named_in(module, doc) and members <= names.keys()]
        for name, text in names.items():
            key[module, name] = next((f"a member of {p}" for p, members in implemented
                                      if name in members), text)
    for module, tree in trees.items():  # a wrapper takes the meaning of what it wraps
        bound = _bound(tree.body, trees)
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and (module, fn.name) in key:
                for home in sorted(_delegates_to(fn, bound, trees)):
                    if (home, fn.name) in key:
                        old, new = key[module, fn.name], key[home, fn.name]
                        key.update({k: new for k, v in key.items() if v == old})
    out: dict[str, dict[str, list[str]]] = {}
    for (module, name), meaning in sorted(key.items()):
        out.setdefault(name, {}).setdefault(meaning, []).append(module)
    return out


def names_with_two_meanings(sources: Mapping[str, str]) -> list[str]:
    """One line per public name defined with different meanings: the name and its modules."""
    return [f"{name}: " + "; ".join(", ".join(ms) for ms in by.values())
            for name, by in sorted(meanings(sources).items()) if len(by) > 1]


def repeated_module_names(files: list[str]) -> list[str]:
    """One line per file name (other than a package's ``__init__``) used in two folders."""
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(Path(f).name, []).append(f)
    return [f"{name}: {', '.join(sorted(fs))}" for name, fs in sorted(by_name.items())
            if len(fs) > 1 and name != PACKAGE_FILE]
