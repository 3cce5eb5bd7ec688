"""The code's shape, read as data (issue "One engine"): import graph, private access, size.

* no import cycles inside ``runtime/``, ``distributed/`` or ``plan/`` — every import counts,
  at module level, under ``TYPE_CHECKING`` or inside a function (a lazy import hides a cycle,
  it does not remove it);
* no module reads another module's underscore attributes: ``obj._name`` where ``_name`` is
  defined by another of our modules, not this one (a third-party library's private API is
  that library's business), or ``from x import _name`` of our modules (except a package's
  own private modules, e.g. the kernels' compiled CFFI module);
* no file over ~400 lines, unless its docstring says why it is one concept
  (``LONG_REASON``, at most ``MAX_LINES_ONE_CONCEPT``);
* one training step reads one way (``scripts/step_trace.py --check``): at most
  ``STEP_RUNTIME_FILES`` files of ``runtime/`` (plus the kernel's layers and the telemetry
  recorder), no call that returns into the file it came from, no call cycle between files,
  at most ``STEP_CALLS`` distinct cross-file calls. Derived from the order of the calls one
  traced iteration makes, not from their timing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "superoffload"
MAX_LINES = 400
MAX_LINES_ONE_CONCEPT = 700
LONG_REASON = "Past 400 lines:"
"""How a module's docstring says why it is one concept though longer (files split by concept,
not by the line count)."""

# one step (scripts/step_trace.py; docs/engine.md, "Reading one step")
STEP_RUNTIME_FILES = 15
STEP_CALLS = 110
STEP_TWO_WAY = 0
STEP_CYCLE_FILES = 0

# torch-owned private names we must call (each has one wrapper; see the comment at its use)
TORCH_PRIVATE = {
    "_C", "_current_graph_task_id", "_foreach_mul", "_foreach_mul_", "_foreach_add_",
    "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_", "_foreach_addcdiv_", "_foreach_norm",
    "_foreach_copy_", "_foreach_lerp_", "_foreach_sub_", "_foreach_maximum_",
    "_fused_adamw_", "_fused_adam_", "_base", "_get_default_group", "_dynamo",
    "_foreach_add", "_foreach_sub", "_foreach_div", "_foreach_zero_",
}
PRIVATE_MODULES = {"_cpu_adam_cffi"}  # kernels/cpu_adam.py's compiled module (STYLE.md §7)
STDLIB_PRIVATE = {"_SubParsersAction"}  # argparse's subparsers type (no public name)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every superoffload module ``name`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            if len(subs) < len(node.names):  # names that are not submodules come from base
                found.add(base)
            found.update(subs)
    return {m for m in found if m in MODULES and m != name}


def _cycle(nodes: set[str]) -> list[str] | None:
    graph = {n: {m for m in _imports(n, MODULES[n]) if m in nodes} for n in nodes}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", ["runtime", "distributed", "plan"])
def test_no_import_cycles(package: str) -> None:
    prefix = f"superoffload.{package}"
    # a package's __init__ re-exports its modules by design; the cycle question is between
    # the modules themselves
    nodes = {m for m in MODULES if m.startswith(prefix + ".")}
    cycle = _cycle(nodes)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).parent.parts)


def _private_names_of(path: Path) -> set[str]:
    """Underscore names a module defines: functions, classes, module globals, attributes
    assigned on self, arguments."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)  # attributes of our own objects
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


OWN = {path: _private_names_of(path) for path in MODULES.values()}
OURS = set().union(*OWN.values())


def _private_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in OURS - OWN[path] \
                and node.attr not in TORCH_PRIVATE | STDLIB_PRIVATE:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("superoffload"):
            for alias in node.names:
                own_module = f"{node.module}.{alias.name}" in MODULES and \
                    node.module == _package_of(path)  # a package's private module, inside it
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and alias.name not in PRIVATE_MODULES and not own_module:
                    bad.append(f"{path.name}:{node.lineno}: import {alias.name}")
    return bad


def test_no_module_reads_another_modules_private_names() -> None:
    bad = [b for path in MODULES.values() for b in _private_reads(path)]
    assert not bad, "private access across modules:\n" + "\n".join(bad)


def _says_why_long(path: Path) -> bool:
    """The module docstring says why the file is one concept past ``MAX_LINES``."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return LONG_REASON in doc


def test_no_file_is_over_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and not (n <= MAX_LINES_ONE_CONCEPT and _says_why_long(p))}
    assert not long, (
        f"split these files by concept (over {MAX_LINES} lines): {long}; a file that holds one "
        f"concept may reach {MAX_LINES_ONE_CONCEPT} when its docstring says why, in a "
        f"sentence starting {LONG_REASON!r}")


def test_one_step_reads_one_way() -> None:
    script = PACKAGE.parent / "scripts" / "step_trace.py"
    argv = [sys.executable, str(script), "--check",
            f"--max-runtime-files={STEP_RUNTIME_FILES}", f"--max-calls={STEP_CALLS}",
            f"--max-two-way={STEP_TWO_WAY}", f"--max-cycle-files={STEP_CYCLE_FILES}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, (
        "one training step no longer reads one way (scripts/step_trace.py --check):\n"
        + done.stdout[-4000:] + done.stderr[-2000:])
