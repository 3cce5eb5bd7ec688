"""Build and run the kernel's C harness (cext/harness/) natively and under
qemu-user, and read its output (the format is documented in cext/harness/so_harness.h)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CEXT = ROOT / "cext"
HARNESS = CEXT / "harness"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
REQUIRE_ENV = "SUPEROFFLOAD_REQUIRE_EMULATION"
TIMEOUT_S = 600


def _build_script():
    sys.path.insert(0, str(CEXT))
    try:
        import build_cpu_adam
    finally:
        sys.path.pop(0)
    return build_cpu_adam


def compile_flags() -> list[str]:
    """The kernel's own flags (cext/build_cpu_adam.py), so the harness tests what ships."""
    return list(_build_script().COMPILE_FLAGS)


def missing_tools() -> str | None:
    """Why the emulated runs cannot happen here, or None."""
    missing = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    if missing:
        return (f"needs {' and '.join(missing)} (Debian: apt-get install qemu-user "
                "gcc-aarch64-linux-gnu libc6-dev-arm64-cross)")
    if not Path("/usr/aarch64-linux-gnu/lib/libc.a").exists():
        return "needs the static arm64 libc (Debian: apt-get install libc6-dev-arm64-cross)"
    return None


def sources(cext: Path = CEXT) -> list[Path]:
    """The kernel's sources (build_cpu_adam.SOURCES: what ships) and the harness's."""
    return [cext / s for s in _build_script().SOURCES] + sorted((cext / "harness").glob("*.c"))


def _obj(out: Path, src: Path) -> Path:
    return out / (src.parent.name + "_" + src.stem + ".o")


def compile_objects(cc: str, srcs: Sequence[Path], out: Path, include: Path = CEXT) -> list[Path]:
    """Compile each source to an object in `out`, all at once (the machine's cores)."""
    out.mkdir(parents=True, exist_ok=True)
    flags, procs = compile_flags(), []
    for src in srcs:
        cmd = [cc, *flags, "-Wall", "-Wextra", "-Werror", "-I", str(include), "-I",
               str(include / "harness"), "-c", str(src), "-o", str(_obj(out, src))]
        procs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    errors = []
    for src, proc in procs:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
        if proc.returncode:
            errors.append(f"{src.name}: {log}")
    assert not errors, "\n".join(errors)
    return [_obj(out, s) for s in srcs]


def link(cc: str, objects: Sequence[Path], exe: Path, static: bool) -> Path:
    # -static: no aarch64 sysroot needed at run time; libgomp.a then runs the OpenMP threads
    cmd = [cc, "-fopenmp", *(["-static"] if static else []), *map(str, objects), "-o", str(exe),
           "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    return exe


@dataclass
class HarnessRun:
    """One run's output, parsed."""

    label: str
    returncode: int
    stdout: str
    dispatch: dict[str, str] = field(default_factory=dict)
    path: str = ""
    vl_bytes: int = -1
    omp_threads: int = 0
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks: int = 0
    done: bool = False

    def summary(self) -> str:
        return f"{self.label}: rc={self.returncode}, failures: {self.failures[:5]}"


def parse(label: str, returncode: int, stdout: str) -> HarnessRun:
    run = HarnessRun(label, returncode, stdout)
    for line in stdout.splitlines():
        words = line.split()
        if not words:
            continue
        key = words[0]
        if key == "dispatch":
            run.dispatch = dict(w.split("=", 1) for w in words[1:])
        elif key == "path":
            run.path = words[1]
        elif key == "vl_bytes":
            run.vl_bytes = int(words[1])
        elif key == "omp_threads":
            run.omp_threads = int(words[1])
        elif key == "digest":
            run.digests[words[1]] = (words[2], words[3])
        elif key == "check":
            run.checks += 1
            if words[2] != "ok":
                run.failures.append(line)
        elif key == "done":
            run.done = True
    return run


def start(cmd: Sequence[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # 4 threads on a 2-core CI machine
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def run_all(commands: dict[str, Sequence[str]]) -> dict[str, HarnessRun]:
    """Run every command at once and parse each output."""
    procs = {label: start(cmd) for label, cmd in commands.items()}
    out = {}
    for label, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        out[label] = parse(label, proc.returncode, stdout + stderr)
    return out


def qemu_command(exe: Path, cpu: str, simd: str, *extra: str) -> list[str]:
    return [QEMU, "-cpu", cpu, str(exe), "--simd", simd, *extra]


def mutate_sve_tail(src_cext: Path, dst: Path) -> Path:
    """A copy of cext/ whose SVE loop forgets its last partial vector (only whole vectors
    are stepped: the classic wrong tail). NEON and x86 are unchanged."""
    shutil.copytree(src_cext, dst)
    body = dst / "so_adam_body.h"
    text = body.read_text()
    loop = "    for (int64_t i = lo; i < hi; ++i) {\n        float g ="
    assert text.count(loop) == 1, "so_adam_body.h changed: update the mutation"
    body.write_text(text.replace(loop, loop.replace("i < hi", "i < SO_MUTANT_HI(lo, hi)")))
    simd = dst / "so_simd.c"
    text = simd.read_text()
    sve = '#define SO_SUFFIX sve\n'
    assert text.count(sve) == 1, "so_simd.c changed: update the mutation"
    text = text.replace('#include "so_internal.h"\n',
                        '#include "so_internal.h"\n#define SO_MUTANT_HI(lo, hi) (hi)\n')
    text = text.replace(sve, "#include <arm_sve.h>\n#undef SO_MUTANT_HI\n"
                             "#define SO_MUTANT_HI(lo, hi)"
                             " ((hi) - ((hi) - (lo)) % (int64_t)svcntw())\n" + sve)
    simd.write_text(text)
    return dst
