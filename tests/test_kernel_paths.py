"""SIMD paths, thread counts, layouts and backends agree bit for bit; the build is what we
claim (vectorised, aarch64 NEON/SVE compiles, stale builds refused, fallback warns once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _harness_support import compile_flags
from _kernel_support import assert_same_bits, make_state, run, step_kwargs

import superoffload.kernels as K

ROOT = Path(__file__).resolve().parents[1]
CEXT = ROOT / "cext"
needs_cffi = pytest.mark.skipif(K.backend() != "cffi", reason="compiled kernel not built")
VARIANTS = [
    (torch.float32, torch.float32, None, dict()),
    (torch.bfloat16, torch.float32, torch.bfloat16, dict(adamw_mode=False, weight_decay=0.1)),
    (torch.float32, torch.bfloat16, torch.float16, dict(weight_decay=0.01, grad_scale=0.3)),
]


def _available_paths() -> list[str]:
    from superoffload.kernels import cpu_adam

    out = []
    for name in ("portable", "avx2", "avx512", "neon", "sve"):
        code = cpu_adam._SIMD_CODES[name]
        if cpu_adam.lib.so_simd_resolve(code) == code:
            out.append(name)
    return out


@needs_cffi
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_simd_path_and_the_fallback_give_the_same_bits(variant, monkeypatch):
    from superoffload.kernels import cpu_adam, torch_ref

    gdt, mdt, lpdt, opts = VARIANTS[variant]
    base = make_state(100_003, seed=variant, grad_dtype=gdt, moment_dtype=mdt, lp_dtype=lpdt)
    kw = step_kwargs(**opts)
    ref = base.clone()
    run(torch_ref.adam_step_multi, ref, sr_seed=5, **kw)
    paths = _available_paths()
    assert "portable" in paths or "neon" in paths
    for path in paths:
        monkeypatch.setenv("SUPEROFFLOAD_SIMD", path)
        assert K.simd_path() == path
        s = base.clone()
        run(cpu_adam.adam_step_multi, s, sr_seed=5, **kw)
        assert_same_bits(s, ref)
        run(cpu_adam.adam_rollback_multi, s, sr_seed=5, **kw)
        r = ref.clone()
        run(torch_ref.adam_rollback_multi, r, sr_seed=5, **kw)
        assert_same_bits(s, r)


@needs_cffi
def test_unknown_or_missing_simd_path_is_an_error(monkeypatch):
    monkeypatch.setenv("SUPEROFFLOAD_SIMD", "mmx")
    with pytest.raises(ValueError, match="SUPEROFFLOAD_SIMD"):
        K.simd_path()
    monkeypatch.setenv("SUPEROFFLOAD_SIMD", "sve" if sys.platform != "darwin" else "avx512")
    if "sve" not in _available_paths():
        with pytest.raises(RuntimeError, match="SUPEROFFLOAD_SIMD"):
            K.simd_path()


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_thread_count_does_not_change_a_bit(variant):
    gdt, mdt, lpdt, opts = VARIANTS[variant]
    sizes = [70_001, 3, 129_999, 64, 1]
    states = [make_state(n, seed=i, grad_dtype=gdt, moment_dtype=mdt, lp_dtype=lpdt)
              for i, n in enumerate(sizes)]
    results = []
    for threads in (1, 2, 3):
        ss = [s.clone() for s in states]
        K.adam_step_multi([s.p for s in ss], [s.g for s in ss], [s.m for s in ss],
                          [s.v for s in ss], params_lp=None if lpdt is None else [s.lp for s in ss],
                          threads=threads, sr_seed=9, **step_kwargs(**opts))
        results.append(ss)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_same_bits(a, b)


def test_many_tensors_equal_one_flat_buffer():
    """One call over a list equals one call over the concatenation (stochastic rounding
    included: its hash runs on the global element index)."""
    sizes = [5, 4096, 77_777, 1, 30_000]
    states = [make_state(n, seed=i, moment_dtype=torch.bfloat16, lp_dtype=torch.bfloat16)
              for i, n in enumerate(sizes)]
    flat = [torch.cat([getattr(s, k) for s in states]) for k in ("p", "g", "m", "v", "lp")]
    kw = step_kwargs(weight_decay=0.1)
    K.adam_step_multi([s.p for s in states], [s.g for s in states], [s.m for s in states],
                      [s.v for s in states], params_lp=[s.lp for s in states], sr_seed=3, **kw)
    K.adam_step(flat[0], flat[1], flat[2], flat[3], param_lp=flat[4], sr_seed=3, **kw)
    for i, k in enumerate(("p", "m", "v", "lp")):
        joined = torch.cat([getattr(s, k) for s in states])
        # compared as bit patterns, so that equal means bit-identical
        bits = torch.int16 if joined.element_size() == 2 else torch.int32
        # flat[1] is g, which the loop skips
        assert torch.equal(joined.view(bits), flat[i if i == 0 else i + 1].view(bits))


def test_params_lp_list_may_hold_none():
    a, b = make_state(1000, seed=1, lp_dtype=torch.bfloat16), make_state(999, seed=2)
    K.adam_step_multi([a.p, b.p], [a.g, b.g], [a.m, b.m], [a.v, b.v], params_lp=[a.lp, None],
                      **step_kwargs())
    assert torch.equal(a.lp, a.p.to(torch.bfloat16))


def test_grad_stats_matches_float64_and_counts_nonfinite():
    g1 = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    g1[[5, 99_999]] = torch.tensor([float("nan"), -float("inf")])
    g2 = torch.randn(4097, dtype=torch.float32).to(torch.bfloat16)
    for grads in ([g1], [g1, torch.zeros(0)], [g2]):
        total, bad = K.grad_stats_multi(grads)
        finite = [g.double()[torch.isfinite(g.double())] for g in grads]
        want = sum(float((f * f).sum()) for f in finite)
        assert abs(total - want) <= 1e-12 * want
        assert bad == sum(int((~torch.isfinite(g)).sum()) for g in grads)
    assert K.grad_stats(g1) == K.grad_stats_multi([g1])


def test_grad_stats_same_bits_for_any_thread_count_and_backend():
    from superoffload.kernels import torch_ref

    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3
             for n in (300_001, 17, 8192)]
    runs = {K.grad_stats_multi(grads, threads) for threads in (1, 2, 3)}
    runs.add(torch_ref.grad_stats_multi(grads))
    assert len(runs) == 1, runs


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=120)


def test_env_var_forces_the_torch_fallback():
    out = _run_python("import superoffload.kernels as K; print(K.backend(), K.simd_path())",
                      SUPEROFFLOAD_KERNEL="torch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "torch"]


def test_missing_build_falls_back_with_one_warning():
    code = """
import importlib.abc, sys, warnings
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.endswith("_cpu_adam_cffi"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import superoffload.kernels as K
    import torch
    p = torch.zeros(10); K.adam_step(p, torch.ones(10), torch.zeros(10), torch.zeros(10),
                                     step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
print(K.backend(), sum("fallback" in str(w.message) for w in caught), round(float(p[0]), 4))
"""
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "1", "-0.1"]


@needs_cffi
def test_stale_build_is_refused_with_rebuild_hint():
    code = """
import sys, types
import superoffload.kernels._cpu_adam_cffi as real
fake = types.ModuleType(real.__name__)
fake.ffi = real.ffi
fake.lib = types.SimpleNamespace(so_kernel_abi_version=lambda: 999)
sys.modules[real.__name__] = fake
sys.modules.pop("superoffload.kernels.cpu_adam")  # imported (fine) with the package
try:
    import superoffload.kernels.cpu_adam
except ImportError as exc:
    print("ImportError:", exc)
"""
    out = _run_python(code)
    assert "ImportError:" in out.stdout and "pip install -e ." in out.stdout, (
        out.stdout + out.stderr)


def _compile(cc: str, tmp_path: Path, extra: list[str],
             sources: tuple[str, ...] = ("so_cpu_adam.c", "so_simd.c")) -> str:
    outputs = []
    for src in sources:
        cmd = [cc, *compile_flags(), *extra, "-Wall", "-Werror", "-I", str(CEXT), "-c",
               str(CEXT / src), "-o", str(tmp_path / (src + ".o")), "-fopt-info-vec-optimized"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        outputs.append(res.stderr)
    return "\n".join(outputs)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None
                    or not Path("/usr/aarch64-linux-gnu/include/stdlib.h").exists(),
                    reason="needs Debian's gcc-aarch64-linux-gnu and libc6-dev-arm64-cross")
def test_aarch64_build_compiles_neon_and_sve(tmp_path):
    """The Grace build (NEON baseline + SVE chosen by getauxval) compiles and vectorises.
    Debian's cross compiler may come without arm64 libc headers; the sources need only the
    compiler's own headers, so -ffreestanding is enough then."""
    probe = subprocess.run(["aarch64-linux-gnu-gcc", "-x", "c", "-c", "-o", os.devnull, "-"],
                           input="#include <stdint.h>\n", capture_output=True, text=True)
    extra = [] if probe.returncode == 0 else ["-ffreestanding"]
    log = _compile("aarch64-linux-gnu-gcc", tmp_path, extra)
    assert "variable length vectors" in log  # the SVE loops
    assert "16 byte vectors" in log  # the NEON loops


@pytest.mark.skipif(shutil.which("gcc") is None or os.uname().machine != "x86_64",
                    reason="needs gcc on x86-64")
def test_x86_build_vectorises_every_path(tmp_path):
    log = _compile("gcc", tmp_path, [], sources=("so_simd.c",))  # the loops live there
    for width in ("16 byte vectors", "32 byte vectors", "64 byte vectors"):
        assert width in log  # portable (SSE2), AVX2, AVX-512
    assert "couldn't vectorize" not in log
