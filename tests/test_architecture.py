"""The code's shape, read as data: import graph, private access, size, layers, pointers.

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
  traced iteration makes, not from their timing;
* lower layers never import upper ones (``LAYERS``);
* every pointer resolves (tests/pointer_rules.py finds them): no tracker numbers, every path
  in prose names something in the tree, nothing cited from another project, every name
  imported from the module that defines it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from pointer_rules import (
    CITATION,
    PATH,
    TRACKER,
    TRACKER_WORD,
    indirect_imports,
    origin,
    outside_citations,
    resolves,
    tracker_numbers,
    unresolved_paths,
)

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
PRIVATE_MODULES = {"_cpu_adam_cffi"}  # kernels/cpu_adam.py's compiled module (docs/conventions.md, "Kernel bindings in three layers")
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


# (lower package, upper package): the lower never imports the upper
LAYERS = (("superoffload.telemetry", "superoffload.widgets"),
          ("superoffload.plan", "superoffload.runtime"))


@pytest.mark.parametrize(("lower", "upper"), LAYERS)
def test_lower_layers_never_import_upper_ones(lower: str, upper: str) -> None:
    bad = [f"{path.relative_to(PACKAGE.parent)}: imports {dep}"
           for name, path in MODULES.items() if name == lower or name.startswith(lower + ".")
           for dep in sorted(_imports(name, path)) if dep == upper or dep.startswith(upper + ".")]
    assert not bad, f"{lower} must not import {upper}:\n" + "\n".join(bad)


# ------------------------------------------------------------------ pointers
def test_no_tracker_numbers() -> None:
    bad = tracker_numbers()
    assert not bad, ("say what is meant, or cite the paper section or a doc of this repository "
                     "(docs/conventions.md, \"Comments say why and cite the paper\"); "
                     f"{len(bad)} found:\n" + "\n".join(bad))


def test_every_path_in_prose_resolves() -> None:
    bad = unresolved_paths()
    assert not bad, ("write a path from the repository root or from superoffload/ (a bare name "
                     "only for a sibling or a unique file name), a placeholder in <angle "
                     "brackets> "
                     f"(docs/testing.md, \"Pointers that resolve\"); {len(bad)} found:\n"
                     + "\n".join(bad))


def test_nothing_is_cited_from_outside_the_repository() -> None:
    bad = outside_citations()
    assert not bad, ("say in our words what the code follows (docs/conventions.md holds the "
                     "conventions) or drop the reference; another project's files are not "
                     f"cited (docs/testing.md, \"Pointers that resolve\"); {len(bad)} found:\n"
                     + "\n".join(bad))


def test_names_are_imported_from_where_they_are_defined() -> None:
    bad = indirect_imports()
    assert not bad, ("import each name from the module that defines it (a package may offer "
                     "names it lists in __all__); then drop the module's re-export "
                     f"(docs/testing.md, \"Pointers that resolve\"); {len(bad)} found:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("line, found", [
    (f"(see {TRACKER_WORD} 11, item 3)", True), (f"{TRACKER_WORD.title()} #7: a hang", True),
    (f"{TRACKER_WORD}s 2 and 11", True), (f"docs/img/{TRACKER_WORD}19/a.png", True),
    (f"two {TRACKER_WORD}s 2x faster", False), (f"t{TRACKER_WORD} 3", False), (f"the {TRACKER_WORD} at hand", False),
])
def test_tracker_numbers_are_recognised(line: str, found: bool) -> None:
    assert bool(TRACKER.search(line)) is found


@pytest.mark.parametrize("line, refs", [
    ("see runtime/stv.py and docs/engine.md", ["runtime/stv.py", "docs/engine.md"]),
    ("`torchrun --nproc-per-node N <your_script>.py`", []),
    ("deepspeedai/DeepSpeed:deepspeed/runtime/zero/stage_1_and_2.py", []),
    ("https://pytorch.org/docs/stable/optim.html", []),
])
def test_paths_are_found_in_prose(line: str, refs: list[str]) -> None:
    assert [m.group(1) for m in PATH.finditer(line)] == refs


@pytest.mark.parametrize("line, cited", [
    ("(deepspeedai/DeepSpeed:deepspeed/runtime/zero/stage_1_and_2.py)", True),
    ("see https://github.com/pytorch/pytorch/blob/main/x.py", True),
    ("runtime/stv.py, docs/engine.md and `cuda:0`", False),
    ("runtime/launch.py:Launcher.begin (a file and its function)", False),
    ("the PyTorch documentation (https://pytorch.org/docs/stable/optim.html)", False),
])
def test_citations_are_recognised(line: str, cited: bool) -> None:
    assert bool(CITATION.search(line)) is cited


@pytest.mark.parametrize("ref, src, ok", [
    ("runtime/stv.py", "docs/engine.md", True),               # from superoffload/
    ("superoffload/runtime/stv.py", "README.md", True),      # from the root
    ("stv.py", "superoffload/runtime/engine.py", True),      # a sibling
    ("conventions.md", "README.md", True),                   # a doc
    ("plan/buckets.plan_buckets", "docs/planner.md", True),  # module.attribute
    ("runs/latest/report.html", "docs/main_job.md", True),   # an output path
    ("STYLE.md", "README.md", False),                        # not in the repository
    ("distributed/zero/engine.py", "docs/distributed.md", False),  # a removed file
    ("zero/transport.py", "docs/distributed.md", False),     # a removed folder
    ("torch/optim/lr_scheduler.py", "README.md", False),     # another project's, unnamed
    ("no_such_file.py", "README.md", False),
])
def test_the_path_rule(ref: str, src: str, ok: bool) -> None:
    assert resolves(ref, src) is ok


def test_a_name_is_traced_to_the_module_that_defines_it() -> None:
    # telemetry/metrics.py imports Span from telemetry/events.py and defines IterationMetrics
    assert origin("superoffload.telemetry.metrics", "Span") == "superoffload.telemetry.events"
    assert origin("superoffload.telemetry.metrics", "IterationMetrics") == \
        "superoffload.telemetry.metrics"
    assert origin("superoffload.telemetry.metrics", "no_such_name") is None
