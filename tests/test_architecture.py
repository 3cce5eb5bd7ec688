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
  traced iteration makes, not from their timing. The FSDP2 engine's step likewise
  (``--fsdp``), with ``distributed/`` as its edge and budgets of its own (``FSDP_STEP_*``);
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
from name_rules import names_with_two_meanings, package_sources, repeated_module_names
from pointer_rules import (
    CITATION,
    PATH,
    TRACKER,
    TRACKER_WORD,
    has_name,
    indirect_imports,
    named_pointers,
    origin,
    outside_citations,
    resolves,
    tracker_numbers,
    unresolved_names,
    unresolved_paths,
)

PACKAGE = Path(__file__).resolve().parents[1] / "superoffload"
MAX_LINES = 400
MAX_LINES_ONE_CONCEPT = 700
LONG_REASON = "Past 400 lines:"
"""How a module's docstring says why it is one concept though longer (files split by concept,
not by the line count)."""

# one step (scripts/step_trace.py; docs/engine.md, "Reading one step")
# 18 files, 122 calls: the optimizer (runtime/optimizer.py), the boundary (runtime/boundary.py)
# and the copy lanes both transports hold (runtime/copy_lanes.py: one file, 5 delegations)
STEP_RUNTIME_FILES = 18
STEP_CALLS = 122
STEP_TWO_WAY = 0
STEP_CYCLE_FILES = 0
# the FSDP2 engine's step (--fsdp, one gloo rank in process): the single-process step's
# runtime/ files plus runtime/hook_base.py (the unit hooks) and runtime/transport.py (the
# validation vector), less runtime/local_transport.py; in distributed/: the unit hooks, the
# transport, the engine (the gradient-sync rule), the validation all-reduce, the guarded
# collectives and their guard
FSDP_STEP_RUNTIME_FILES = 19
FSDP_STEP_EDGE_FILES = 6
FSDP_STEP_CALLS = 132

# torch-owned private names we must call (each has one wrapper; see the comment at its use)
TORCH_PRIVATE = {
    "_C", "_current_graph_task_id", "_foreach_mul", "_foreach_mul_", "_foreach_add_",
    "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_", "_foreach_addcdiv_", "_foreach_norm",
    "_foreach_copy_", "_foreach_lerp_", "_foreach_sub_", "_foreach_maximum_",
    "_fused_adamw_", "_fused_adam_", "_base", "_get_default_group", "_dynamo",
    "_foreach_add", "_foreach_sub", "_foreach_div", "_foreach_zero_",
}
# kernels/cpu_adam.py's compiled module (docs/conventions.md, "Kernel bindings in three layers")
PRIVATE_MODULES = {"_cpu_adam_cffi"}
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


def _step_trace(*args: str) -> subprocess.CompletedProcess[str]:
    script = PACKAGE.parent / "scripts" / "step_trace.py"
    return subprocess.run([sys.executable, str(script), "--check", *args], capture_output=True,
                          text=True, timeout=600, cwd=PACKAGE.parent)


def test_one_step_reads_one_way() -> None:
    done = _step_trace(f"--max-runtime-files={STEP_RUNTIME_FILES}", f"--max-calls={STEP_CALLS}",
                       f"--max-two-way={STEP_TWO_WAY}", f"--max-cycle-files={STEP_CYCLE_FILES}")
    assert done.returncode == 0, (
        "one training step no longer reads one way (scripts/step_trace.py --check):\n"
        + done.stdout[-4000:] + done.stderr[-2000:])


def test_the_fsdp2_step_reads_one_way() -> None:
    """The FSDP2 engine's step: FSDP2 at the edge (distributed/), the transports sharing their
    parts by composition, the unit hooks calling the transport one way (docs/distributed.md,
    "One iteration")."""
    done = _step_trace("--fsdp", f"--max-runtime-files={FSDP_STEP_RUNTIME_FILES}",
                       f"--max-edge-files={FSDP_STEP_EDGE_FILES}",
                       f"--max-calls={FSDP_STEP_CALLS}", f"--max-two-way={STEP_TWO_WAY}",
                       f"--max-cycle-files={STEP_CYCLE_FILES}")
    assert done.returncode == 0, (
        "the FSDP2 step no longer reads one way (scripts/step_trace.py --fsdp --check):\n"
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
    (f"two {TRACKER_WORD}s 2x faster", False), (f"t{TRACKER_WORD} 3", False),
    (f"the {TRACKER_WORD} at hand", False),
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


def test_every_named_pointer_resolves() -> None:
    bad = unresolved_names()
    assert not bad, ("point at a name the file defines: `file.py:name`, `file.py:Class.method`, "
                     "`module/path.name` (docs/testing.md, \"Pointers that resolve\"); "
                     f"{len(bad)} found:\n" + "\n".join(bad))


@pytest.mark.parametrize("line, src, ok", [
    ("runtime/launch.py:Launcher.begin", "docs/engine.md", True),          # a method
    ("superoffload/config.py:OffloadConfig.step_order", "README.md", True),  # a field
    ("launch.py:Launcher.iteration", "superoffload/runtime/engine.py", True),  # set on self
    ("plan/buckets.plan_buckets", "docs/planner.md", True),                # module.name
    ("commands/argtypes.for_field", "superoffload/config.py", False),      # no such function
    ("runtime/launch.py:Launcher.no_such", "docs/engine.md", False),       # no such member
    ("runtime/launch.py:no_such", "docs/engine.md", False),
])
def test_the_name_rule(line: str, src: str, ok: bool) -> None:
    found = list(named_pointers(src, line))
    assert found and all(has_name(file, name) for _, file, name in found) is ok


# ------------------------------------------------------------------ one name, one meaning
def test_one_name_means_one_thing() -> None:
    bad = names_with_two_meanings(package_sources())
    assert not bad, ("give each meaning a name of its own, or an underscore when no other module "
                     "uses it (docs/testing.md, \"One name, one meaning\"); name: the modules "
                     f"of each meaning, {len(bad)} found:\n" + "\n".join(bad))


_PROTOCOL = ('from typing import Protocol\nclass Backend(Protocol):\n'
             '    """What a.py and b.py provide."""\n    def run(self) -> int: ...\n')


@pytest.mark.parametrize("sources, flagged", [
    ({"superoffload.a": "X = 1\n", "superoffload.b": "X = 2\n"}, ["X"]),
    ({"superoffload.a": "X = 1\n", "superoffload.b": "X = 1\n"}, []),   # one definition
    ({"superoffload.a": "_X = 1\n", "superoffload.b": "_X = 2\n"}, []),  # private
    ({"superoffload.a": "X = 1\n",                                     # a re-export
      "superoffload.b": "from superoffload import a\nX = a.X\n"}, []),
    ({"superoffload.a": "def f(raw):\n    return raw\n",                 # a wrapper
      "superoffload.b": "from superoffload import a\ndef f(path):\n    return a.f(path)\n"}, []),
    ({"superoffload.p": _PROTOCOL, "superoffload.a": "def run():\n    return 1\n",
      "superoffload.b": "def run():\n    return 2\n"}, []),                # one protocol
    ({"superoffload.p": _PROTOCOL, "superoffload.a": "def run():\n    return 1\n",
      "superoffload.c": "def run():\n    return 2\n"}, ["run"]),           # c: not named
])
def test_the_name_rule_reads_meanings_from_the_code(sources: dict[str, str],
                                                     flagged: list[str]) -> None:
    assert [line.split(":")[0] for line in names_with_two_meanings(sources)] == flagged


def test_one_module_name_names_one_file() -> None:
    bad = repeated_module_names([str(p.relative_to(PACKAGE.parent)) for p in MODULES.values()])
    assert not bad, ("name each module after what it holds (docs/testing.md, \"One name, one "
                     f"meaning\"); {len(bad)} names in several folders:\n" + "\n".join(bad))


@pytest.mark.parametrize("files, flagged", [
    (["superoffload/runtime/weights.py", "superoffload/plan/weights.py"], ["weights.py"]),
    (["superoffload/runtime/__init__.py", "superoffload/plan/__init__.py"], []),
    (["superoffload/runtime/weight_policy.py", "superoffload/plan/weights.py"], []),
])
def test_the_module_name_rule(files: list[str], flagged: list[str]) -> None:
    assert [line.split(":")[0] for line in repeated_module_names(files)] == flagged


# ------------------------------------------------------------------ private writes
THIRD_PARTY_PRIVATE_WRITES = {"_timeout"}
"""Another library's private attributes we must set (each has one use; see the comment
there): ``_timeout`` on torch's gloo process-group options, which have no public one
(distributed/mesh.py)."""


def _private_writes(path: Path) -> list[str]:
    """``obj._name = ...`` (or ``setattr(obj, "_name", ...)``, ``del obj._name``) where
    ``_name`` is not one of ours: another library's private state (torch's ``_opt_called``
    was written so, to keep an LR scheduler from warning)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        if name and name.startswith("_") and not name.startswith("__") \
                and name not in OURS | THIRD_PARTY_PRIVATE_WRITES:
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return bad


def test_no_module_writes_another_librarys_private_attributes() -> None:
    bad = [b for path in MODULES.values() for b in _private_writes(path)]
    assert not bad, ("use the library's public API (integrations/offloaded_optimizer.py "
                     "step_without_gradients tells an LR scheduler of a step the engine took):\n"
                     + "\n".join(bad))
