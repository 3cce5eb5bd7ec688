"""Argument checks of the CPU Adam kernels, shared by the C wrapper and the torch fallback.

Two stages, so a prepared call (kernels/prepared.py) pays for the expensive one once:

* ``check_tensors`` — types, dtypes, device, contiguity, lengths and memory overlap of the
  tensor lists (O(n log n), below): once per prepared call, giving a frozen ``AdamTensors``;
* ``check_call`` — the per-call numbers: the hyper-parameters (one ``AdamHyper``,
  kernels/hyper.py: the one hyper-parameter type), step, grad_scale, sr_seed and threads,
  in a few microseconds, giving a frozen ``AdamCall`` that both backends consume.

Every check runs BEFORE any memory is touched, and a failure raises TypeError (wrong type
or dtype) or ValueError (wrong value, device, layout, length or overlap) naming the argument
and the fix (docs/kernel.md, "API").

Memory overlap: what one call writes must not overlap. The kernel walks every tensor once
and writes ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``params_lp`` in place while it
reads ``grads``. Identity is not enough to decide whether two arguments may share memory:
views of one storage at different offsets, a bf16 copy overlapping its fp32 master by one
element, or the same tensor twice in one multi call all have distinct tensor objects (or
distinct ``data_ptr()``) and would be computed wrongly (a later element reads a value an
earlier one already rewrote). So the check compares BYTE RANGES
``[data_ptr, data_ptr + numel * element_size)`` of contiguous tensors:

* no two written ranges may overlap (same tensor twice included);
* no gradient may overlap a written range;
* gradients may overlap each other: the kernel only reads them, so two aliasing gradients
  (a tied weight's grad passed twice, say) compute exactly what they would as copies.
  ``torch._foreach_*`` ops allow the same.

Sorting the written ranges is O(n log n) for n tensors, done once per prepared call
(kernels/prepared.py); a gradient is then checked by bisection in O(log n), so a call that
brings new gradients each step (CPUAdam with ``zero_grad(set_to_none=True)``) pays
O(n log n) per step, not O(n^2).
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import torch

from superoffload.kernels.hyper import AdamHyper
from superoffload.threads import optimizer_threads, usable_cores

# ---------------------------------------------------------------------------- memory overlap
_FIX = ("every tensor a call writes (params, exp_avgs, exp_avg_sqs, params_lp) needs memory "
        "of its own, and a grad must not alias any of them; pass .clone()d tensors")


@dataclass(frozen=True, slots=True)
class WrittenRanges:
    """The disjoint byte ranges a call writes, sorted by start (so also by end)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    owners: tuple[tuple[str, int], ...]
    """(list name, index) of each range: "exp_avgs", 3 -> exp_avgs[3]."""

    def name(self, k: int) -> str:
        return f"{self.owners[k][0]}[{self.owners[k][1]}]"


def _error(a: str, b: str) -> ValueError:
    return ValueError(f"{a} and {b} share memory (their byte ranges overlap): {_FIX}")


TensorList = tuple[str, Sequence[int], Sequence[int], int]
"""(list name, data pointers, element counts, element size) of one list of tensors."""


def written_ranges(lists: Sequence[TensorList]) -> WrittenRanges:
    """Sort the written tensors' ranges and refuse any overlap; empty tensors take no
    memory. One sort of (start, end, list, index) tuples: O(n log n)."""
    spans = sorted((start, start + n * size, li, i)
                   for li, (_, ptrs, numels, size) in enumerate(lists)
                   for i, (start, n) in enumerate(zip(ptrs, numels)) if n)
    # Sorted by start, and every range before the current one is disjoint from its
    # predecessors (we stop at the first overlap), so the previous range has the largest
    # end so far: comparing neighbours finds any overlap.
    for k in range(1, len(spans)):
        if spans[k][0] < spans[k - 1][1]:
            a, b = spans[k - 1], spans[k]
            raise _error(f"{lists[a[2]][0]}[{a[3]}]", f"{lists[b[2]][0]}[{b[3]}]")
    return WrittenRanges(tuple(sp[0] for sp in spans), tuple(sp[1] for sp in spans),
                         tuple((lists[sp[2]][0], sp[3]) for sp in spans))


def check_read_only_ranges(written: WrittenRanges, name: str, starts: Sequence[int],
                           numels: Sequence[int], element_size: int) -> None:
    """Refuse a read-only tensor (a grad) that overlaps anything the call writes, from its
    already read pointer and length: O(log n) per tensor by bisection in the written ranges."""
    w_starts, w_ends = written.starts, written.ends
    if not w_starts:
        return
    for i, (start, n) in enumerate(zip(starts, numels)):
        if n:
            end = start + n * element_size
            # the written range starting last before end
            k = bisect_left(w_starts, end) - 1
            if k >= 0 and w_ends[k] > start:
                raise _error(f"{name}[{i}]", written.name(k))


# ---------------------------------------------------------------------------- the checks
GRAD_DTYPES = (torch.float32, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
LP_DTYPES = (torch.bfloat16, torch.float16)
# the largest finite fp32: grad_scale is used as (float)
FLT_MAX = 3.4028234663852886e38
_G = frozenset(GRAD_DTYPES)
# unbound C methods: map() over them keeps the per-tensor loops of per-call checks in C
_dtype_of = attrgetter("dtype")
_numel = torch.Tensor.numel
_is_cpu = attrgetter("is_cpu")
_is_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr


@dataclass(frozen=True, slots=True)
class AdamTensors:
    """The tensors of one multi-tensor call, validated: equal-length lists of CPU,
    contiguous tensors of the accepted dtypes whose written memory does not overlap."""

    params: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...]
    exp_avgs: tuple[torch.Tensor, ...]
    exp_avg_sqs: tuple[torch.Tensor, ...]
    params_lp: tuple[torch.Tensor | None, ...] | None
    numels: tuple[int, ...]
    grad_dtype: torch.dtype
    moment_dtype: torch.dtype
    lp_dtype: torch.dtype | None
    written: WrittenRanges
    """Byte ranges of params, exp_avgs, exp_avg_sqs and params_lp (checked disjoint)."""
    grad_ptrs: tuple[int, ...] | None = None
    """``data_ptr()`` of each grad when ``with_grads`` read them already (else None)."""

    def with_grads(self, grads: object) -> AdamTensors:
        """The same call with other gradient tensors (checked: same lengths, one accepted
        dtype, contiguous CPU, not overlapping anything written). Cheap, O(n log n): five
        C-level reads per tensor on the common path (this runs on every CPUAdam step), the
        per-tensor messages on the slow one."""
        # the per-step path: CPUAdam passes a list, used as is (anything else: checked, copied)
        gs = grads if type(grads) is list else _as_list("grads", grads)
        if len(gs) != len(self.params):
            raise ValueError(f"grads has {len(gs)} entries but the prepared call has "
                             f"{len(self.params)} params")
        try:
            dtypes = set(map(_dtype_of, gs))
            numels = tuple(map(_numel, gs))
            # is_contiguous() is False for a sparse COO tensor and raises for CSR
            ok = (len(dtypes) <= 1 and dtypes <= _G and numels == self.numels
                  and all(map(_is_cpu, gs)) and all(map(_is_contiguous, gs)))
        except (AttributeError, RuntimeError, TypeError):
            # not tensors, or sparse
            ok = False
        # find the culprit for the message
        if not ok:
            for i, g in enumerate(gs):
                _check_tensor(f"grads[{i}]", g, GRAD_DTYPES)
                if g.numel() != self.numels[i]:
                    raise ValueError(f"grads[{i}] has {g.numel()} elements but params[{i}] "
                                     f"has {self.numels[i]}")
            _same_dtype("grads", gs)
        # no grads (an empty call): fp32, the kernel's default
        grad_dtype = next(iter(dtypes), torch.float32)
        ptrs = tuple(map(_data_ptr, gs))
        check_read_only_ranges(self.written, "grads", ptrs, numels, grad_dtype.itemsize)
        return replace(self, grads=tuple(gs), grad_dtype=grad_dtype, grad_ptrs=ptrs)


SCHEDULES = ("static", "dynamic")


@dataclass(frozen=True, slots=True)
class ExecOptions:
    """How a kernel call runs, never what it computes: every result is a pure function of
    the element and its global index, so all options give the same bits (tests check it).
    The defaults are the measured choice (docs/kernel.md, "Threads")."""

    schedule: str = "static"
    """"static": one contiguous range per thread; "dynamic": chunks handed out on demand, so
    one preempted thread does not stretch the call. Static is the default:
    dynamic measured 0.86-1.02x of it with the data in DRAM (docs/kernel.md)."""
    chunk_elems: int = 65536
    """Elements per chunk of the dynamic schedule (a multiple of 64; the kernel makes chunks
    smaller when a call has fewer than 4 per thread)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ExecOptions.schedule={self.schedule!r}: use one of {SCHEDULES}")
        if (isinstance(self.chunk_elems, bool) or not isinstance(self.chunk_elems, int)
                or self.chunk_elems < 64 or self.chunk_elems % 64):
            raise ValueError(f"ExecOptions.chunk_elems={self.chunk_elems!r}: use a multiple "
                             "of 64 (one cache line of fp32 x 4 arrays)")


DEFAULT_EXEC = ExecOptions()


@dataclass(frozen=True, slots=True)
class AdamCall:
    """One validated call: the tensors, one ``AdamHyper`` and the per-call numbers."""

    tensors: AdamTensors
    hyper: AdamHyper
    step: int
    """The step t >= 1 being taken (or undone): bias corrections use t."""
    grad_scale: float
    """g = grad * grad_scale (unscale and clip fused in); negative under ``hyper.maximize``
    (a step with -grad: the sign flip is exact, in both backends)."""
    sr_seed: int
    """Stochastic-rounding stream of bf16 moments."""
    threads: int
    options: ExecOptions = DEFAULT_EXEC


def default_threads() -> int:
    """Threads when the caller says None: the one thread rule (superoffload.threads, the
    affinity mask, DESIGN.md §6), not torch.get_num_threads()."""
    return optimizer_threads(usable_cores(), 1.0)


def check_threads(threads: object) -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int >= 1 or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (or None for the usable cores), got {threads}")
    return threads


def _f32(x: float) -> float:
    """x rounded to fp32 (the C side's `(float)x`), without a torch op."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def check_call(tensors: AdamTensors, hyper: object, *, step: object, grad_scale: object,
               sr_seed: object, threads: object, rollback: bool, where: str,
               options: object = None) -> AdamCall:
    """The per-call numbers of a call over already validated tensors (a few microseconds)."""
    if options is None:
        options = DEFAULT_EXEC
    elif not isinstance(options, ExecOptions):
        raise TypeError(f"{where}: options must be a superoffload.kernels.ExecOptions or "
                        f"None, got {type(options).__name__}")
    if not isinstance(hyper, AdamHyper):
        raise TypeError(f"{where}: hyper must be a superoffload.kernels.AdamHyper, got "
                        f"{type(hyper).__name__}; build one with AdamHyper(...) or "
                        "AdamHyper.from_group(group)")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (the step number t >= 1), got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first step is 1), got {step}")
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)):
        raise TypeError(f"grad_scale must be a real number, got {type(grad_scale).__name__}")
    gs = float(grad_scale)
    # NaN fails too
    if not 0.0 <= gs <= FLT_MAX:
        raise ValueError(f"grad_scale must be finite (in fp32) and >= 0, got {gs}")
    if isinstance(sr_seed, bool) or not isinstance(sr_seed, int):
        raise TypeError(f"sr_seed must be an int, got {type(sr_seed).__name__}")
    if not 0 <= sr_seed < 2**64:
        raise ValueError(f"sr_seed must be in [0, 2**64), got {sr_seed}")
    if rollback:
        # the inverse divides by beta in fp32: it must be representable and > 0 there
        for name, beta in (("beta1", hyper.beta1), ("beta2", hyper.beta2)):
            if _f32(beta) <= 0.0:
                raise ValueError(f"adam_rollback cannot invert a step with {name}={beta}: "
                                 f"use {name} > 0")
    if hyper.maximize:
        # ascend: step with -grad, folded into the scale (exact, and no pass over the grads)
        gs = -gs
    return AdamCall(tensors, hyper, step, gs, sr_seed, check_threads(threads), options)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout} (sparse grads "
                        "are not supported)")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}; move it with .cpu()")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous() (and copy back)")
    return t


def _as_list(name: str, seq: object) -> list:
    if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _same_dtype(name: str, tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(
            f"all {name} must share one dtype in a call, got {sorted(map(str, dtypes))}")
    return next(iter(dtypes), None)


def _scan(seq: list, allowed: frozenset) -> tuple[tuple[int, ...], tuple[int, ...], set] | None:
    """(numels, data pointers, dtypes) of a list of acceptable tensors in a few C-level
    passes, or None when any entry needs the per-tensor check (for its message)."""
    try:
        dtypes = set(map(_dtype_of, seq))
        if not (dtypes <= allowed and all(map(_is_cpu, seq)) and all(map(_is_contiguous, seq))):
            return None
        return tuple(map(_numel, seq)), tuple(map(_data_ptr, seq)), dtypes
    except (AttributeError, RuntimeError, TypeError):
        # not tensors, or sparse
        return None


def _checked(name: str, seq: list, dtypes: tuple[torch.dtype, ...]
             ) -> tuple[tuple[int, ...], tuple[int, ...], set]:
    scanned = _scan(seq, frozenset(dtypes))
    if scanned is None:
        for i, t in enumerate(seq):
            _check_tensor(f"{name}[{i}]", t, dtypes)
        scanned = _scan(seq, frozenset(dtypes))
        assert scanned is not None
    if len(scanned[2]) > 1:
        _same_dtype(name, seq)
    return scanned


def check_tensors(params: object, grads: object, exp_avgs: object, exp_avg_sqs: object,
                  params_lp: object = None) -> AdamTensors:
    """Validate the tensor lists of a multi-tensor call; raises before anything is touched.
    ``grads=None``: the gradients come with each call (``AdamTensors.with_grads``)."""
    ps = _as_list("params", params)
    gs = None if grads is None else _as_list("grads", grads)
    ms, vs = _as_list("exp_avgs", exp_avgs), _as_list("exp_avg_sqs", exp_avg_sqs)
    lps = None if params_lp is None else _as_list("params_lp", params_lp)
    n = len(ps)
    for name, seq in (("grads", gs), ("exp_avgs", ms), ("exp_avg_sqs", vs), ("params_lp", lps)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries but params has {n}")
    p_n, p_ptr, _ = _checked("params", ps, (torch.float32,))
    m_n, m_ptr, m_dt = _checked("exp_avgs", ms, MOMENT_DTYPES)
    v_n, v_ptr, v_dt = _checked("exp_avg_sqs", vs, MOMENT_DTYPES)
    # grads=None: they come with each call, so they match by construction here
    g: tuple[tuple[int, ...], tuple[int, ...], set] = (p_n, (), set())
    if gs is not None:
        g = _checked("grads", gs, GRAD_DTYPES)
    g_n, g_ptr, g_dt = g
    # a None entry of params_lp: that param has no low-precision copy to write
    lp_idx = [i for i, t in enumerate(lps or ()) if t is not None]
    lp_n, lp_ptr, lp_dt = _checked("params_lp", [(lps or [])[i] for i in lp_idx], LP_DTYPES)
    for name, numels, idx in (("grads", g_n, range(n)), ("exp_avgs", m_n, range(n)),
                              ("exp_avg_sqs", v_n, range(n)), ("params_lp", lp_n, lp_idx)):
        want = tuple(p_n[i] for i in idx)
        if numels != want:
            j = next(k for k, (a, b) in enumerate(zip(numels, want)) if a != b)
            i = idx[j]
            raise ValueError(f"{name}[{i}] has {numels[j]} elements but params[{i}] has {p_n[i]}")
    if m_dt != v_dt:
        _same_dtype("exp_avgs and exp_avg_sqs", ms + vs)
    moment_dtype = next(iter(m_dt), torch.float32)
    lp_dtype = next(iter(lp_dt), None)
    mom_size = moment_dtype.itemsize
    # params_lp ranges indexed like params; a param without a copy writes nothing there
    lp_ptrs, lp_numels = [0] * n, [0] * n
    for k, i in enumerate(lp_idx):
        lp_ptrs[i], lp_numels[i] = lp_ptr[k], p_n[i]
    written = written_ranges([("params", p_ptr, p_n, 4), ("exp_avgs", m_ptr, m_n, mom_size),
                              ("exp_avg_sqs", v_ptr, v_n, mom_size),
                              ("params_lp", lp_ptrs, lp_numels, 2)])
    grad_dtype = next(iter(g_dt), torch.float32)
    if gs is not None:
        check_read_only_ranges(written, "grads", g_ptr, g_n, grad_dtype.itemsize)
    return AdamTensors(tuple(ps), tuple(gs or ()), tuple(ms), tuple(vs),
                       None if lps is None else tuple(lps), p_n, grad_dtype, moment_dtype,
                       lp_dtype, written, g_ptr if gs is not None else None)


def check_grads(grads: object) -> list[torch.Tensor]:
    gs = _as_list("grads", grads)
    for i, g in enumerate(gs):
        _check_tensor(f"grads[{i}]", g, GRAD_DTYPES)
    _same_dtype("grads", gs)
    return gs
