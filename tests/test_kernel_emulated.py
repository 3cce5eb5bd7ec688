"""The Arm paths executed: the kernel's C harness (cext/harness/) built with the
kernel's own flags, run natively on every x86-64 path, and cross-built for aarch64 and run
under qemu-user on a NEON-only CPU and on SVE CPUs with 128-, 256- and 512-bit vectors.

* Each run checks itself against float64 (cext/harness/so_harness_ref.c states the bounds)
  and exits non-zero on any failure, guard-zone overwrite or wrong return code.
* Every run's digests equal the native run's, bit for bit (-ffp-contract=off: no FMA on
  any path). One known exception: a step over inf/NaN inputs makes default NaNs, negative
  on x86-64 (0xffc00000) and positive on AArch64 (0x7fc00000), and which operand's NaN a
  two-NaN operation propagates depends on the compiler; there only the canonical digest
  (every NaN mapped to one pattern; all other bits exact) must match.
* Dispatch: AUTO resolves to NEON on the NEON-only CPU (SVE refused) and to SVE elsewhere,
  at the vector length qemu was asked for.

Skips, with the reason, only where qemu-aarch64 or the cross compiler is missing; CI sets
SUPEROFFLOAD_REQUIRE_EMULATION=1 (.ci/run installs both), which makes that a failure.
CI cost: ~30 s of compiling and ~40 s of emulation (the four CPUs run at once), on 2 cores.
"""

from __future__ import annotations

import os
import platform
import shutil

import pytest
from _harness_support import (
    CEXT,
    CROSS_CC,
    REQUIRE_ENV,
    HarnessRun,
    compile_objects,
    link,
    missing_tools,
    mutate_sve_tail,
    qemu_command,
    run_all,
    sources,
)

# label: (qemu -cpu, path to run, the path AUTO must pick, SVE vector bytes)
EMULATED = {
    "neon-only (neoverse-n1)": ("neoverse-n1", "neon", "neon", 0),
    "sve128": ("max,sve-max-vq=1", "sve", "sve", 16),
    "sve256": ("max,sve-max-vq=2", "sve", "sve", 32),
    "sve512": ("max,sve-max-vq=4", "sve", "sve", 64),
}
NAN_CASES = "nonfinite_step/"  # NaN bits may differ across ISAs (module docstring)
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # ~45 s on 2 idle cores


def _need_emulation() -> None:
    reason = missing_tools()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the emulated runs cannot happen: {reason}")
    pytest.skip(reason)


def _native_cc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler for the native harness")
    return cc


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("harness")


@pytest.fixture(scope="module")
def native_runs(build_dir) -> dict[str, HarnessRun]:
    """The harness on every path this machine has (x86-64: portable, AVX2, AVX-512)."""
    exe = link(_native_cc(), compile_objects(_native_cc(), sources(), build_dir / "native"),
               build_dir / "so_harness_native", static=False)
    probe = run_all({"probe": [str(exe), "--simd", "auto", "--quick"]})["probe"]
    assert probe.dispatch, probe.stdout
    paths = sorted({p for name, p in probe.dispatch.items() if name != "auto" and p != "none"})
    return run_all({p: [str(exe), "--simd", p] for p in paths})


@pytest.fixture(scope="module")
def arm_objects(build_dir) -> list:
    _need_emulation()
    return compile_objects(CROSS_CC, sources(), build_dir / "aarch64")


@pytest.fixture(scope="module")
def emulated_runs(build_dir, arm_objects) -> dict[str, HarnessRun]:
    exe = link(CROSS_CC, arm_objects, build_dir / "so_harness_aarch64", static=True)
    return run_all({label: qemu_command(exe, cpu, simd)
                    for label, (cpu, simd, _, _) in EMULATED.items()})


def _reference(native_runs: dict[str, HarnessRun]) -> HarnessRun:
    return native_runs[sorted(native_runs)[0]]


def _compare_digests(run: HarnessRun, ref: HarnessRun, quick: bool = False) -> list[str]:
    """Cases whose digest differs (exact bits; canonical NaNs for the NaN cases). A
    --quick run has a subset of the cases."""
    if quick:
        assert set(run.digests) <= set(ref.digests) and run.digests, run.digests.keys()
    else:
        assert set(run.digests) == set(ref.digests), set(run.digests) ^ set(ref.digests)
    differ = []
    for case, got in run.digests.items():
        exact, canonical = ref.digests[case]
        same = got[1] == canonical if case.startswith(NAN_CASES) else got == (exact, canonical)
        if not same:
            differ.append(case)
    return differ


def test_native_paths_pass_float64_checks_and_agree_bit_for_bit(native_runs):
    ref = _reference(native_runs)
    expected = {"portable", "avx2", "avx512"} if platform.machine() == "x86_64" else {"neon"}
    assert expected & set(native_runs), native_runs.keys()
    for run in native_runs.values():
        assert run.returncode == 0 and run.done and not run.failures, run.summary()
        assert run.checks > 150 and len(run.digests) > 60
        assert run.omp_threads == 4, "OpenMP did not give the harness 4 threads"
        assert _compare_digests(run, ref) == [], f"{run.label} differs from {ref.label}"


@pytest.mark.parametrize("label", list(EMULATED))
def test_emulated_path_passes_and_matches_x86_bit_for_bit(label, emulated_runs, native_runs):
    run, (cpu, simd, auto, vl_bytes) = emulated_runs[label], EMULATED[label]
    assert run.returncode == 0 and run.done and not run.failures, run.summary()
    # the run-time dispatch: NEON on a NEON-only CPU, SVE wherever the CPU has it
    assert run.dispatch["auto"] == auto, run.dispatch
    assert run.dispatch["sve"] == ("sve" if auto == "sve" else "none"), run.dispatch
    assert run.dispatch["portable"] == "neon" and run.path == simd
    assert run.vl_bytes == vl_bytes, f"qemu -cpu {cpu} ran SVE at {run.vl_bytes} bytes"
    assert run.omp_threads == 4, "static libgomp did not start 4 threads under qemu"
    ref = _reference(native_runs)
    assert _compare_digests(run, ref) == [], f"{label} differs from native {ref.label}"


def test_a_wrong_sve_tail_is_caught(build_dir, arm_objects, emulated_runs):
    """A copy of cext/ whose SVE loop skips its last partial vector: the float64 checks
    and the digests both catch it at every vector length, and NEON is untouched."""
    mutant = mutate_sve_tail(CEXT, build_dir / "mutant_cext")
    simd_obj = compile_objects(CROSS_CC, [mutant / "so_simd.c"], build_dir / "mutant",
                               include=mutant)
    objects = [o for o in arm_objects if not o.name.endswith("_so_simd.o")] + simd_obj
    exe = link(CROSS_CC, objects, build_dir / "so_harness_mutant", static=True)
    runs = run_all({"sve128": qemu_command(exe, EMULATED["sve128"][0], "sve", "--quick"),
                    "neon": qemu_command(exe, EMULATED["neon-only (neoverse-n1)"][0], "neon",
                                         "--quick")})
    sve, neon = runs["sve128"], runs["neon"]
    assert sve.returncode != 0 and sve.done, sve.stdout[-2000:]
    assert any(f.startswith("check tails/") for f in sve.failures)
    differing = _compare_digests(sve, emulated_runs["sve128"], quick=True)
    assert any(case.startswith("tails/") for case in differing)
    assert neon.returncode == 0 and not neon.failures, neon.summary()
