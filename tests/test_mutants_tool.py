"""The mutation check's tool (scripts/mutants.py; docs/testing.md): the curated list still
applies to this tree, and the mechanics are right on a toy tree: a snippet must occur exactly
once, only tracked and untracked-not-ignored files are copied, a mutant is applied in the copy only
(the source tree is never written), caught / survived are told apart, and the exit code is
non-zero when a mutant cannot be applied. (The whole check, `make mutants`, is slow and runs
outside CI: docs/testing.md.) Two pytest starts on the toy tree: ~5 s."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutants_tool", ROOT / "scripts" / "mutants.py")
assert _spec is not None and _spec.loader is not None
mt = importlib.util.module_from_spec(_spec)
sys.modules["mutants_tool"] = mt  # dataclasses look their module up while the class is built
_spec.loader.exec_module(mt)

TOY = {
    "toy.py": "def double(x):\n    return 2 * x\n\n\ndef unused():\n    return 1\n",
    "test_toy.py": "from toy import double\n\n\ndef test_double():\n    assert double(3) == 6\n",
    ".gitignore": "ignored.txt\n",
    "ignored.txt": "a build output\n",
}


def write_list(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def mutant_toml(name: str, old: str, new: str, tests: str = '["test_toy.py"]',
                file: str = "toy.py", extra: str = "") -> str:
    return (f"[[mutant]]\nname = '{name}'\nfile = '{file}'\nbug = 'a bug'\nold = '''{old}'''\n"
            f"new = '''{new}'''\ntests = {tests}\n{extra}\n")


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TOY.items():
        (src / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=src, check=True)
    subprocess.run(["git", "add", "toy.py"], cwd=src, check=True)  # tracked; the rest untracked
    return src


def test_every_curated_mutant_applies_to_this_tree() -> None:
    mutants = mt.load_mutants()
    assert len(mutants) >= 15
    problems = {m.name: why for m in mutants if (why := mt.applies(m, ROOT)) is not None}
    assert not problems, problems  # the code moved: update scripts/mutants.toml with it


@pytest.mark.parametrize(("body", "message"), [
    (mutant_toml("a", "x", "y", extra="colour = 'red'"), "unknown field"),
    (mutant_toml("a", "x", "y", tests="[]"), "'tests' must be a non-empty list"),
    (mutant_toml("a", "x", "x"), "the same text"),
    (mutant_toml("a", "x", "y", file="cext/k.c"), "needs rebuild = true"),
    (mutant_toml("a", "x", "y") + mutant_toml("a", "x", "z"), "two mutants are named 'a'"),
])
def test_a_malformed_list_is_refused_naming_the_mutant(tmp_path: Path, body: str,
                                                       message: str) -> None:
    with pytest.raises(mt.MutantListError, match=message):
        mt.load_mutants(write_list(tmp_path / "m.toml", body))


def test_a_snippet_must_occur_exactly_once(toy: Path, tmp_path: Path) -> None:
    mutants = mt.load_mutants(write_list(tmp_path / "m.toml", "".join([
        mutant_toml("once", "return 2 * x", "return 3 * x"),
        mutant_toml("twice", "    return ", "    return -"),
        mutant_toml("never", "return 4 * x", "return 3 * x"),
        mutant_toml("no-test", "return 2 * x", "return 3 * x", tests='["test_gone.py"]'),
    ])))
    why = {m.name: mt.applies(m, toy) for m in mutants}
    assert why["once"] is None
    assert "occurs 2 times" in why["twice"] and "occurs 0 times" in why["never"]
    assert "test_gone.py does not exist" in why["no-test"]
    # --check exits non-zero when one does not apply, and writes nothing
    args = ["--check", "--root", str(toy), "--mutants", str(tmp_path / "m.toml")]
    assert mt.main(args) == 1
    assert (toy / "toy.py").read_text() == TOY["toy.py"]


def test_mutants_run_in_a_copy_caught_and_survived_told_apart(toy: Path, tmp_path: Path) -> None:
    copy, kernel = tmp_path / "copy", tmp_path / "kernel"
    kernel.mkdir()
    mt.copy_tree(toy, copy)
    assert sorted(p.name for p in copy.iterdir()) == [".gitignore", "test_toy.py", "toy.py"]
    mutants = mt.load_mutants(write_list(tmp_path / "m.toml", "".join([
        mutant_toml("doubles-wrong", "return 2 * x", "return 3 * x"),
        mutant_toml("untested", "return 1", "return 2"),
    ])))
    outcomes = {m.name: mt.run_mutant(m, copy, kernel, timeout_s=300) for m in mutants}
    assert outcomes["doubles-wrong"].result == "caught"
    assert outcomes["doubles-wrong"].detail == "test_toy.py::test_double"
    assert outcomes["untested"].result == "SURVIVED"
    # the copy is put back after each mutant; the source tree was never written
    assert (copy / "toy.py").read_text() == TOY["toy.py"]
    assert (toy / "toy.py").read_text() == TOY["toy.py"]
    table = mt.table(list(zip(mutants, outcomes.values())))
    assert "| doubles-wrong | toy.py | a bug | caught |" in table
    assert "| untested | toy.py | a bug | SURVIVED |" in table
