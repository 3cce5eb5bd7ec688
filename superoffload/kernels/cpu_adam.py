"""Thin wrapper over the compiled CFFI kernel `superoffload.kernels._cpu_adam_cffi`.

Three layers (docs/conventions.md, "Kernel bindings in three layers"): cext/so_cpu_adam.h
declares, the private compiled module implements, this file checks every argument
(kernels/checks.py, before any memory is touched) and turns every return code into an
exception. Importing it fails with ImportError when the compiled module is missing or was
built from another version of cext/.

SUPEROFFLOAD_SIMD=auto|portable|avx2|avx512|neon|sve picks the SIMD path per call
(default auto: the best the CPU has); simd_path() reports the one that runs.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.kernels.checks import (
    AdamCall,
    AdamTensors,
    check_grads,
    check_tensors,
    check_threads,
)
from superoffload.kernels.openmp import start_throttle
from superoffload.kernels.prepared import multi_entry_points

try:
    from superoffload.kernels._cpu_adam_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:
    # missing build: the package falls back to torch_ref
    raise ImportError(f"superoffload's C kernel is not built ({exc}); build it with "
                      "`pip install -e .` (or `make install`)") from exc

# Must equal SO_KERNEL_ABI_VERSION in cext/so_cpu_adam.h.
EXPECTED_ABI_VERSION = 7


class StaleBuildError(ImportError):
    """The compiled module was built from a different cext/ than this wrapper expects."""


if lib.so_kernel_abi_version() != EXPECTED_ABI_VERSION:
    raise StaleBuildError(
        f"superoffload.kernels._cpu_adam_cffi has ABI version {lib.so_kernel_abi_version()}, "
        f"the wrapper expects {EXPECTED_ABI_VERSION}: the build is stale. Rebuild it with "
        "`pip install -e .` (or `make install`).")

SIMD_ENV = "SUPEROFFLOAD_SIMD"
_SIMD_CODES = {"auto": lib.SO_SIMD_AUTO, "portable": lib.SO_SIMD_PORTABLE,
               "avx2": lib.SO_SIMD_AVX2, "avx512": lib.SO_SIMD_AVX512,
               "neon": lib.SO_SIMD_NEON, "sve": lib.SO_SIMD_SVE}
_SIMD_NAMES = {code: name for name, code in _SIMD_CODES.items()}
_DTYPE_CODES = {torch.float32: lib.SO_DTYPE_F32, torch.bfloat16: lib.SO_DTYPE_BF16,
                torch.float16: lib.SO_DTYPE_F16, None: lib.SO_DTYPE_NONE}
_SCHEDULES = {"static": lib.SO_SCHED_STATIC, "dynamic": lib.SO_SCHED_DYNAMIC}
_NONFINITE = {lib.SO_ERR_NONFINITE_PARAM: "param", lib.SO_ERR_NONFINITE_EXP_AVG: "exp_avg",
              lib.SO_ERR_NONFINITE_EXP_AVG_SQ: "exp_avg_sq", lib.SO_ERR_NONFINITE_GRAD: "grad"}


# read on every call: the only cost of the check below
_throttle_started = False
_throttle_lock = threading.Lock()


def _first_call() -> None:
    """The process's first kernel call settles the OpenMP wait policy (kernels/openmp.py:
    it may park a pool with a kernel call of its own, which must not come back here, so
    the flag is set before). Import starts no thread; this runs once per process."""
    global _throttle_started
    with _throttle_lock:
        if _throttle_started:
            return
        _throttle_started = True
    start_throttle(_park_pool)


def _park_pool(threads: int) -> None:
    """One kernel region of exactly `threads` threads (grad_stats gives a thread at least
    32 Ki elements: SO_MIN_ELEMS_PER_THREAD in cext/so_cpu_adam.c)."""
    grad_stats_multi([torch.zeros(threads * 32768, dtype=torch.bfloat16)], threads)


def _requested_simd() -> int:
    name = os.environ.get(SIMD_ENV, "auto").strip().lower() or "auto"
    if name not in _SIMD_CODES:
        raise ValueError(f"{SIMD_ENV}={name!r} is not one of {sorted(_SIMD_CODES)}")
    return _SIMD_CODES[name]


def _resolved_simd() -> int:
    code = lib.so_simd_resolve(_requested_simd())
    if code < 0:
        raise RuntimeError(f"{SIMD_ENV}={os.environ.get(SIMD_ENV)!r} asks for a SIMD path this "
                           "CPU (or this build) does not have; unset it or use 'portable'")
    return int(code)


def simd_path() -> str:
    """The SIMD path the next call runs: avx512, avx2, portable, neon or sve."""
    return _SIMD_NAMES[_resolved_simd()]


def _raise_for(rc: int, what: str) -> None:
    if rc == lib.SO_OK:
        return
    if rc in _NONFINITE:
        raise ValueError(f"{what}: {_NONFINITE[rc]} holds non-finite values, so the step cannot "
                         "be inverted; nothing was modified (skip the rollback and restore "
                         "from a snapshot)")
    if rc == lib.SO_ERR_HPARAM:
        raise ValueError(f"{what}: hyper-parameters rejected by the kernel (out of range in fp32)")
    if rc == lib.SO_ERR_SCRATCH:
        raise MemoryError(f"{what}: the kernel could not allocate its per-call offsets")
    if rc == lib.SO_ERR_SIMD:
        raise RuntimeError(f"{what}: SIMD path unavailable; unset {SIMD_ENV}")
    raise RuntimeError(f"{what}: kernel returned error code {rc}")


def _ptrs(ctype: str, tensors: Sequence[Any]) -> tuple[Any, Any]:
    """A C array of data pointers (NULL for None). Built as uintptr_t and reinterpreted:
    one cffi call instead of one ffi.cast per tensor (a 200-tensor step stays cheap)."""
    addrs = ffi.new("uintptr_t[]", [0 if t is None else t.data_ptr() for t in tensors])
    return addrs, ffi.cast(f"{ctype}*", addrs)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """The so_adam_tensors struct of a call and the cdata arrays it points into (they
    must outlive every C call that uses the struct: a prepared call holds this)."""

    struct: Any
    keep: tuple[Any, ...]


def describe(t: AdamTensors) -> Descriptor:
    """Build the C descriptor of validated tensors (once per prepared call)."""
    params, exp_avgs = _ptrs("float *", t.params), _ptrs("void *", t.exp_avgs)
    exp_avg_sqs, grads = _ptrs("void *", t.exp_avg_sqs), _ptrs("void *", t.grads)
    numels = ffi.new("int64_t[]", list(t.numels))
    s = ffi.new("so_adam_tensors *")
    s.params, s.grads, s.exp_avgs, s.exp_avg_sqs = params[1], grads[1], exp_avgs[1], exp_avg_sqs[1]
    s.numels = numels
    keep: tuple[Any, ...] = (params, grads, exp_avgs, exp_avg_sqs, numels)
    if t.params_lp is not None and t.lp_dtype is not None:
        lps = _ptrs("void *", t.params_lp)
        s.params_lp = lps[1]
        keep += (lps,)
    s.count = len(t.params)
    s.grad_dtype = _DTYPE_CODES[t.grad_dtype]
    s.moment_dtype = _DTYPE_CODES[t.moment_dtype]
    s.lp_dtype = _DTYPE_CODES[t.lp_dtype]
    return Descriptor(s, keep)


def describe_grads(desc: Descriptor, t: AdamTensors) -> Descriptor:
    """A copy of ``desc`` pointing at other gradients (validated in ``t``): one array."""
    s = ffi.new("so_adam_tensors *", desc.struct[0])
    if t.grad_ptrs is not None:
        addrs = ffi.new("uintptr_t[]", t.grad_ptrs)
        grads = (addrs, ffi.cast("void **", addrs))
    else:
        grads = _ptrs("void *", t.grads)
    s.grads = grads[1]
    s.grad_dtype = _DTYPE_CODES[t.grad_dtype]
    return Descriptor(s, (*desc.keep, grads))


def run(desc: Descriptor, call: AdamCall, rollback: bool) -> None:
    """Apply a validated call in one parallel region."""
    if not _throttle_started:
        _first_call()
    hp, hy = call, call.hyper
    h = ffi.new("so_adam_hparams *", {
        "lr": hy.lr, "beta1": hy.beta1, "beta2": hy.beta2, "eps": hy.eps,
        "weight_decay": hy.weight_decay, "grad_scale": hp.grad_scale, "step": hp.step,
        "adamw_mode": int(hy.adamw_mode), "bias_correction": int(hy.bias_correction),
        "sr_seed": hp.sr_seed})
    opt = call.options
    x = ffi.new("so_exec *", {"threads": call.threads, "simd": _requested_simd(),
                              "schedule": _SCHEDULES[opt.schedule],
                              "chunk_elems": opt.chunk_elems})
    if rollback:
        _raise_for(lib.so_adam_rollback_multi(desc.struct, h, x), "adam_rollback")
    else:
        _raise_for(lib.so_adam_step_multi(desc.struct, h, x), "adam_step")


adam_step_multi, adam_rollback_multi = multi_entry_points(sys.modules[__name__])  # type: ignore[arg-type]


def bandwidth_probe(params, grads, exp_avgs, exp_avg_sqs, *, threads=None) -> None:
    """Benchmark probe: the fp32 step's memory traffic (28 B/param) with no Adam maths:
    p += g, m += g, v += g in one parallel region. Its speed is the step's floor."""
    if not _throttle_started:
        _first_call()
    desc = describe(check_tensors(params, grads, exp_avgs, exp_avg_sqs))
    _raise_for(lib.so_bandwidth_probe(desc.struct, check_threads(threads), _requested_simd()),
               "bandwidth_probe")


@dataclass(frozen=True, slots=True)
class StatsDescriptor:
    """The arrays of one grad_stats call (pointers, lengths, per-block scratch)."""

    addrs: Any
    numels: Any
    count: int
    dtype: int
    blocks: int
    scratch: Any


def grad_stats_describe(gs: list[torch.Tensor]) -> StatsDescriptor:
    numels = ffi.new("int64_t[]", [g.numel() for g in gs])
    blocks = int(lib.so_grad_stats_blocks(numels, len(gs)))
    dtype = _DTYPE_CODES[gs[0].dtype] if gs else lib.SO_DTYPE_F32
    return StatsDescriptor(_ptrs("void *", gs), numels, len(gs), dtype, blocks,
                           ffi.new("double[]", max(blocks, 1)))


def grad_stats_run(d: StatsDescriptor, threads: int) -> tuple[float, int]:
    if not _throttle_started:
        _first_call()
    sum_sq = ffi.new("double *")
    nonfinite = ffi.new("int64_t *")
    rc = lib.so_grad_stats_multi(d.addrs[1], d.numels, d.count, d.dtype, threads,
                                 _requested_simd(), d.scratch, d.blocks, sum_sq, nonfinite)
    _raise_for(rc, "grad_stats")
    return float(sum_sq[0]), int(nonfinite[0])


def grad_stats_multi(grads, threads=None) -> tuple[float, int]:
    """(sum of squares of the finite values in fp64, count of non-finite values)."""
    gs = check_grads(grads)
    return grad_stats_run(grad_stats_describe(gs), check_threads(threads))


def rollback_risk_multi(grads: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                        grad_scale: float, c_v: float, threads: int | None = None) -> int:
    """Elements with (g * grad_scale)^2 > c_v * v (cext/so_guard.c; the rollback guard)."""
    if not _throttle_started:
        _first_call()
    gs = check_grads(grads)
    if len(exp_avg_sqs) != len(gs) or any(
            v.dtype != torch.float32 or not v.is_contiguous() or v.device.type != "cpu"
            or v.numel() != g.numel() for v, g in zip(exp_avg_sqs, gs)):
        raise ValueError("rollback_risk_multi: one contiguous fp32 CPU exp_avg_sq per "
                         "gradient, of the same length")
    numels = ffi.new("int64_t[]", [g.numel() for g in gs])
    out = ffi.new("int64_t *")
    dtype = _DTYPE_CODES[gs[0].dtype] if gs else lib.SO_DTYPE_F32
    # alive through the call
    g_ptrs, v_ptrs = _ptrs("void *", gs), _ptrs("void *", exp_avg_sqs)
    rc = lib.so_rollback_risk_multi(g_ptrs[1], v_ptrs[1], numels, len(gs), dtype,
                                    float(grad_scale), float(c_v), check_threads(threads), out)
    _raise_for(rc, "rollback_risk")
    return int(out[0])
