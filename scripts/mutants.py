"""Mutation check: put one small bug at a time into a COPY of the tree and run the tests that
should catch it (how to add a mutant: docs/testing.md).

    python scripts/mutants.py                 # every mutant of scripts/mutants.toml (make mutants)
    python scripts/mutants.py --only NAME...  # some of them
    python scripts/mutants.py --check         # only check that each one applies (seconds)
    python scripts/mutants.py --list

Each mutant names a file, an exact snippet ``old`` that must occur exactly once in it, its
replacement ``new`` and the tests that must fail with it. No line numbers: the code moves
under the list, and a snippet that no longer matches exactly once is an error that names the
mutant (edit the list in the same change as the code).

The working tree is never written to. The tree's files (tracked, and untracked ones not
ignored: ``git ls-files -co --exclude-standard``) and the compiled kernel are copied into a
temporary directory; each mutant is applied there, its tests run there with ``PYTHONPATH``
at the copy (checked: ``superoffload.__file__`` and the kernel resolve into it, the kernel
is the compiled one), and the file is put back before the next. A mutant of ``cext/``
(``rebuild = true``) compiles the kernel in the copy (~25 s). The copy is deleted at the
end, whatever happens.

First the union of the mutants' tests runs on the unmutated copy (the baseline): "caught"
means nothing unless those tests pass without the bug. Then per mutant: pytest exit 1 (a
test failed) is "caught", 0 is "SURVIVED", anything else (a collection error, a timeout) is
an "error". Prints a table with the time each took; exits 0 only when every mutant applied
and was caught (1: a survivor, a mutant that does not apply or an error; 2: a bad list or
arguments; 3: the baseline failed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    sys.exit("scripts/mutants.py needs Python >= 3.11 (tomllib)")

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "scripts" / "mutants.toml"
KERNEL_GLOB = "superoffload/kernels/_cpu_adam_cffi*"
# every compiled module of setup.py's cffi_modules: the kernel and the storage I/O engine
MODULE_GLOBS = (KERNEL_GLOB, "superoffload/storage/_aio_cffi*")
KERNEL_SOURCES = ("cext/*.c", "cext/*.h", "cext/*.py")
# The build step of setup.py (cffi_modules), run inside the copy; tmpdir "." because the
# build script names its sources relative to the working directory.
BUILD = ("import runpy\nfor script in ('cext/build_cpu_adam.py', 'cext/build_aio.py'):\n"
         "    runpy.run_path(script)['ffibuilder'].compile(tmpdir='.', verbose=False)")
PROBE = ("import superoffload, superoffload.kernels as k; "
         "from superoffload.kernels import _cpu_adam_cffi as c; "
         "print(superoffload.__file__); print(c.__file__); print(k.backend())")
FIELDS = {"name", "file", "bug", "old", "new", "tests", "rebuild"}


class MutantListError(ValueError):
    """scripts/mutants.toml is malformed; the message names the mutant and the field."""


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    file: str
    """Path relative to the repository root."""
    bug: str
    """What the mutant models, for the table's readers."""
    old: str
    """Exact text that must occur exactly once in ``file``."""
    new: str
    tests: tuple[str, ...]
    """pytest arguments (files or node ids) that must fail with the mutant in place."""
    rebuild: bool = False
    """True for a mutant of cext/: the compiled kernel is rebuilt in the copy."""


@dataclass(frozen=True, slots=True)
class Outcome:
    result: str
    """"caught", "SURVIVED", "not applied" or "error"."""
    seconds: float
    detail: str
    """The first failing test (caught), or why it is an error / not applied."""


def load_mutants(path: Path = LIST) -> list[Mutant]:
    """Read and check the list: every field present and typed, names unique."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    entries = data.get("mutant")
    if not isinstance(entries, list) or not entries:
        raise MutantListError(f"{path}: no [[mutant]] entries")
    out: list[Mutant] = []
    for k, e in enumerate(entries):
        where = f"{path.name}: mutant {e.get('name', k)!r}"
        unknown = sorted(set(e) - FIELDS)
        if unknown:
            raise MutantListError(f"{where}: unknown field(s) {unknown}; use {sorted(FIELDS)}")
        for key in ("name", "file", "bug", "old", "new"):
            if not isinstance(e.get(key), str) or (key != "new" and not e[key].strip()):
                raise MutantListError(f"{where}: field {key!r} must be a non-empty string")
        tests = e.get("tests")
        if not isinstance(tests, list) or not tests or not all(
                isinstance(t, str) and t for t in tests):
            raise MutantListError(f"{where}: field 'tests' must be a non-empty list of pytest "
                                  "arguments (files or node ids)")
        if e["old"] == e["new"]:
            raise MutantListError(f"{where}: 'old' and 'new' are the same text")
        rebuild = e.get("rebuild", False)
        if not isinstance(rebuild, bool):
            raise MutantListError(f"{where}: field 'rebuild' must be true or false")
        if e["file"].startswith("cext/") and not rebuild:
            raise MutantListError(f"{where}: a mutant of cext/ needs rebuild = true")
        out.append(Mutant(e["name"], e["file"], e["bug"], e["old"], e["new"], tuple(tests),
                          rebuild))
    seen: set[str] = set()
    for m in out:
        if m.name in seen:
            raise MutantListError(f"{path.name}: two mutants are named {m.name!r}")
        seen.add(m.name)
    return out


def applies(mutant: Mutant, root: Path) -> str | None:
    """None when ``old`` occurs exactly once in the file under ``root``; else why not."""
    file = root / mutant.file
    if not file.is_file():
        return f"{mutant.file} does not exist"
    count = file.read_text().count(mutant.old)
    if count != 1:
        return (f"its 'old' snippet occurs {count} times in {mutant.file} (must be exactly "
                "once): the code changed; update the mutant in scripts/mutants.toml")
    for test in mutant.tests:
        test_file = test.split("::")[0]
        if not (root / test_file).exists():
            return f"its test {test_file} does not exist"
    return None


def tree_files(root: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore, that exist (not deleted)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def copy_tree(root: Path, dest: Path) -> None:
    """Copy the tree's files and the compiled kernel (an ignored build output) to ``dest``."""
    for rel in tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    for so in (so for pattern in MODULE_GLOBS for so in root.glob(pattern + ".so")):
        shutil.copy2(so, dest / so.relative_to(root))


def kernel_stale(root: Path) -> str | None:
    """Why the working tree's compiled kernel cannot be used as is (missing, or older than
    cext/), else None."""
    built = [so for pattern in MODULE_GLOBS for so in root.glob(pattern + ".so")]
    if len(built) < len(MODULE_GLOBS):
        return "a compiled module is missing in the tree"
    newest = max((p.stat().st_mtime for pat in KERNEL_SOURCES for p in root.glob(pat)),
                 default=0.0)
    if newest > min(p.stat().st_mtime for p in built):
        return "the compiled kernel is older than cext/"
    return None


def child_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc: a mutated file is never read from cache
    env.pop("SUPEROFFLOAD_KERNEL", None)  # the compiled kernel, not the torch fallback
    return env


def run_bounded(cmd: Sequence[str], cwd: Path, env: dict[str, str],
                timeout_s: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, stdout+stderr). The process and its children run in
    their own session, killed on timeout or Ctrl-C (the ranks of multi-process tests start
    sessions of their own; tests/_dist_support.py bounds and kills them)."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        code: int | None = None
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None or code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return code, log.read().decode(errors="replace")


def build_kernel(copy: Path, timeout_s: float) -> str | None:
    """Compile cext/ of the copy into its superoffload/kernels; None, or the error."""
    remove_kernel(copy)
    code, log = run_bounded([sys.executable, "-c", BUILD], copy, child_env(copy), timeout_s)
    if code != 0:
        return f"the kernel did not build (exit {code}):\n{log[-3000:]}"
    return None


def remove_kernel(copy: Path) -> None:
    for p in [*(p for pattern in MODULE_GLOBS for p in copy.glob(pattern)),
              *copy.glob("cext/*.o")]:
        p.unlink()


def probe(copy: Path) -> str | None:
    """None when the copy's package and compiled kernel are the ones imported."""
    code, log = run_bounded([sys.executable, "-c", PROBE], copy, child_env(copy), 300)
    lines = log.strip().splitlines()
    if code != 0 or len(lines) < 3:
        return f"cannot import superoffload from the copy:\n{log[-3000:]}"
    pkg, kernel, backend = lines[-3:]
    for what, path in (("superoffload", pkg), ("the compiled kernel", kernel)):
        if not Path(path).resolve().is_relative_to(copy.resolve()):
            return f"{what} resolves to {path}, outside the copy {copy}"
    if backend != "cffi":
        return f"kernels.backend() is {backend!r} in the copy, not 'cffi'"
    return None


def pytest_cmd(tests: Iterable[str], *, stop_first: bool) -> list[str]:
    tests = list(tests)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if not any(t.split("::")[0].endswith(".ipynb") for t in tests):
        cmd += ["-p", "no:nbval"]  # its import chain costs ~4 s of CPU per pytest start
    return cmd + (["-x"] if stop_first else []) + tests


def first_failure(log: str) -> str:
    for line in log.splitlines():
        match = re.match(r"(FAILED|ERROR) (\S+)", line)
        if match:
            return match.group(2)
    return "(see the log)"


def run_tests(copy: Path, tests: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
    return run_bounded(pytest_cmd(tests, stop_first=True), copy, child_env(copy), timeout_s)


def run_mutant(mutant: Mutant, copy: Path, source: Path, timeout_s: float) -> Outcome:
    """Apply ``mutant`` in ``copy``, run its tests, put the file (and kernel) back."""
    t0 = time.monotonic()
    why = applies(mutant, copy)
    if why is not None:
        return Outcome("not applied", 0.0, why)
    file = copy / mutant.file
    original = file.read_bytes()
    try:
        file.write_text(original.decode().replace(mutant.old, mutant.new, 1))
        if mutant.rebuild:
            err = build_kernel(copy, timeout_s) or probe(copy)
            if err is not None:
                return Outcome("error", time.monotonic() - t0, err)
        code, log = run_tests(copy, mutant.tests, timeout_s)
    finally:
        file.write_bytes(original)
        if mutant.rebuild:
            restore_kernel(copy, source)
    seconds = time.monotonic() - t0
    if code == 1:
        return Outcome("caught", seconds, first_failure(log))
    if code == 0:
        return Outcome("SURVIVED", seconds, "every test passed with the bug in place")
    why = "timed out" if code is None else f"pytest exit {code}"
    return Outcome("error", seconds, f"{why}:\n{log[-3000:]}")


def restore_kernel(copy: Path, source: Path) -> None:
    """Put the unmutated kernel back: the one built at the start (``source``)."""
    remove_kernel(copy)
    for so in source.rglob("*.so"):
        target = copy / so.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)


def table(rows: Sequence[tuple[Mutant, Outcome]]) -> str:
    head = "| mutant | file | bug | result | s | caught by / why |\n|---|---|---|---|---:|---|"
    lines = [head]
    for m, o in rows:
        detail = o.detail.splitlines()[0] if o.detail else ""
        lines.append(f"| {m.name} | {m.file} | {m.bug} | {o.result} | {o.seconds:.0f} | "
                     f"{detail} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutant applies exactly once, then exit")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run of the tests (only to iterate on one mutant)")
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="limit per pytest run or kernel build (default 900)")
    ap.add_argument("--mutants", type=Path, default=LIST, help="the list (default: %(default)s)")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.root.resolve()
    try:
        mutants = load_mutants(args.mutants)
    except (MutantListError, tomllib.TOMLDecodeError, OSError) as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutants})
        if unknown:
            print(f"mutants: --only {unknown}: no such mutant (see --list)", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.file}: {m.bug}")
        return 0
    broken = [(m, why) for m in mutants if (why := applies(m, root)) is not None]
    for m, why in broken:
        print(f"mutants: {m.name}: {why}", file=sys.stderr)
    if args.check:
        print(f"{len(mutants) - len(broken)} of {len(mutants)} mutants apply")
        return 1 if broken else 0

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="superoffload-mutants-") as tmp:
        copy, kernel = Path(tmp) / "tree", Path(tmp) / "kernel"
        copy_tree(root, copy)
        kernel.mkdir()
        stale = kernel_stale(root)
        if stale is not None or any(m.rebuild for m in mutants):
            print(f"building the kernel in the copy ({stale or 'for the cext/ mutants'})",
                  flush=True)
            err = build_kernel(copy, args.timeout_s)
            if err is not None:
                print(f"mutants: {err}", file=sys.stderr)
                return 3
        for so in (so for pattern in MODULE_GLOBS for so in copy.glob(pattern + ".so")):
            target = kernel / so.relative_to(copy)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, target)
        err = probe(copy)
        if err is not None:
            print(f"mutants: {err}", file=sys.stderr)
            return 3
        print(f"copy of {root} at {copy}; superoffload and its compiled kernel import from it",
              flush=True)
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            t0 = time.monotonic()
            code, log = run_bounded(pytest_cmd(tests, stop_first=False), copy, child_env(copy),
                                    args.timeout_s * 2)
            if code != 0:
                print(log[-6000:], file=sys.stderr)
                print(f"mutants: the baseline (the mutants' tests without any mutant) failed "
                      f"(exit {code}); fix that first", file=sys.stderr)
                return 3
            print(f"baseline: {len(tests)} test targets pass without mutants "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        rows: list[tuple[Mutant, Outcome]] = []
        for m in mutants:
            outcome = run_mutant(m, copy, kernel, args.timeout_s)
            rows.append((m, outcome))
            print(f"{m.name}: {outcome.result} ({outcome.seconds:.0f} s) "
                  f"{outcome.detail.splitlines()[0] if outcome.detail else ''}", flush=True)
            if outcome.result == "error":
                print(outcome.detail, file=sys.stderr)
    total = time.monotonic() - t_start
    print()
    print(table(rows))
    counts = {r: sum(o.result == r for _, o in rows)
              for r in ("caught", "SURVIVED", "not applied", "error")}
    print(f"\n{counts['caught']} caught, {counts['SURVIVED']} survived, "
          f"{counts['not applied']} not applied, {counts['error']} errors; "
          f"{len(rows)} mutants in {total:.0f} s")
    return 0 if counts["caught"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
