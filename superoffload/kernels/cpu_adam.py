"""Thin wrapper over the compiled CFFI kernel `superoffload.kernels._cpu_adam_cffi`.

Three layers (STYLE.md §7): cext/so_cpu_adam.h declares, the private compiled module
implements, this file checks every argument (validate.py, before any memory is touched)
and turns every return code into an exception. Importing it fails with ImportError when
the compiled module is missing or was built from another version of cext/.

SUPEROFFLOAD_SIMD=auto|portable|avx2|avx512|neon|sve picks the SIMD path per call
(default auto: the best the CPU has); simd_path() reports the one that runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from superoffload.kernels.validate import (
    AdamCall,
    check_adam_call,
    check_grads,
    check_threads,
    multi_entry_points,
)

try:
    from superoffload.kernels._cpu_adam_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:  # missing build: the package falls back to torch_ref
    raise ImportError(f"superoffload's C kernel is not built ({exc}); build it with "
                      "`pip install -e .` (or `make install`)") from exc

# Must equal SO_KERNEL_ABI_VERSION in cext/so_cpu_adam.h.
EXPECTED_ABI_VERSION = 4


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
_NONFINITE = {lib.SO_ERR_NONFINITE_PARAM: "param", lib.SO_ERR_NONFINITE_EXP_AVG: "exp_avg",
              lib.SO_ERR_NONFINITE_EXP_AVG_SQ: "exp_avg_sq", lib.SO_ERR_NONFINITE_GRAD: "grad"}


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
    if rc == lib.SO_ERR_SIMD:
        raise RuntimeError(f"{what}: SIMD path unavailable; unset {SIMD_ENV}")
    raise RuntimeError(f"{what}: kernel returned error code {rc}")


def _ptrs(ctype: str, tensors: list[Any]) -> Any:
    """A C array of data pointers (NULL for None). Built as uintptr_t and reinterpreted:
    one cffi call instead of one ffi.cast per tensor (a 200-tensor step stays cheap)."""
    addrs = ffi.new("uintptr_t[]", [0 if t is None else t.data_ptr() for t in tensors])
    return addrs, ffi.cast(f"{ctype}*", addrs)


def _tensors(call: AdamCall) -> tuple[Any, dict[str, Any]]:
    """The so_adam_tensors struct of a call, and the cdata arrays it points into."""
    n = len(call.params)
    keep = {
        "params": _ptrs("float *", call.params),
        "grads": _ptrs("void *", call.grads),
        "exp_avgs": _ptrs("void *", call.exp_avgs),
        "exp_avg_sqs": _ptrs("void *", call.exp_avg_sqs),
        "numels": ffi.new("int64_t[]", call.numels),
    }
    t = ffi.new("so_adam_tensors *")
    t.params, t.grads = keep["params"][1], keep["grads"][1]
    t.exp_avgs, t.exp_avg_sqs = keep["exp_avgs"][1], keep["exp_avg_sqs"][1]
    t.numels = keep["numels"]
    if call.params_lp is not None and call.lp_dtype is not None:
        keep["params_lp"] = _ptrs("void *", call.params_lp)
        t.params_lp = keep["params_lp"][1]
    t.count = n
    t.grad_dtype = _DTYPE_CODES[call.grad_dtype]
    t.moment_dtype = _DTYPE_CODES[call.moment_dtype]
    t.lp_dtype = _DTYPE_CODES[call.lp_dtype]
    return t, keep


def run(call: AdamCall, rollback: bool) -> None:
    """Apply a validated call in one parallel region (used by the public functions below)."""
    t, _keep = _tensors(call)  # _keep: the arrays must outlive the C call
    hp = call.hp
    h = ffi.new("so_adam_hparams *", {
        "lr": hp.lr, "beta1": hp.beta1, "beta2": hp.beta2, "eps": hp.eps,
        "weight_decay": hp.weight_decay, "grad_scale": hp.grad_scale, "step": hp.step,
        "adamw_mode": int(hp.adamw_mode), "bias_correction": int(hp.bias_correction),
        "sr_seed": hp.sr_seed})
    simd = _requested_simd()
    if rollback:
        _raise_for(lib.so_adam_rollback_multi(t, h, call.threads, simd), "adam_rollback")
    else:
        _raise_for(lib.so_adam_step_multi(t, h, call.threads, simd), "adam_step")


adam_step_multi, adam_rollback_multi = multi_entry_points(run)


def bandwidth_probe(params, grads, exp_avgs, exp_avg_sqs, *, threads=None) -> None:
    """Benchmark probe: the fp32 step's memory traffic (28 B/param) with no Adam maths:
    p += g, m += g, v += g in one parallel region. Its speed is the step's floor."""
    call = check_adam_call(params, grads, exp_avgs, exp_avg_sqs, None, threads, rollback=False,
                           step=1, lr=0.0, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0,
                           adamw_mode=True, bias_correction=True, grad_scale=1.0, sr_seed=0)
    t, _keep = _tensors(call)
    _raise_for(lib.so_bandwidth_probe(t, call.threads, _requested_simd()), "bandwidth_probe")


def grad_stats_multi(grads, threads=None) -> tuple[float, int]:
    gs = check_grads(grads)
    n_threads = check_threads(threads)
    numels = ffi.new("int64_t[]", [g.numel() for g in gs])
    blocks = int(lib.so_grad_stats_blocks(numels, len(gs)))
    scratch = ffi.new("double[]", max(blocks, 1))
    sum_sq = ffi.new("double *")
    nonfinite = ffi.new("int64_t *")
    dtype = _DTYPE_CODES[gs[0].dtype] if gs else lib.SO_DTYPE_F32
    addrs = _ptrs("void *", gs)
    rc = lib.so_grad_stats_multi(addrs[1], numels, len(gs), dtype, n_threads,
                                 _requested_simd(), scratch, blocks, sum_sq, nonfinite)
    _raise_for(rc, "grad_stats")
    return float(sum_sq[0]), int(nonfinite[0])
