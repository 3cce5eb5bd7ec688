"""Cost model: the time of each piece of work, from a HardwareProfile (DESIGN.md §5).

Formulas (paper section in brackets; SuperOffload, Lian et al., arXiv 2509.21271):
  link        t = latency + bytes / peak per direction, per message; with a measured table,
              t = bytes / bw(bytes) (log-interpolated)
              [§4.2: ~64 MB buckets saturate NVLink-C2C]
  CPU Adam    t = call + params / rate(threads) * bytes_per_param / 28
              rate(threads) = min(compute(threads), eff * host_bw / 28 B) x kernel factor, the
              cap applied with or without a measured table [§4.6 GraceAdam: bandwidth bound]
  host lane   the CPU step of a bucket inside the engine shares the host memory bus with both
              DMA directions (DESIGN.md §6 "host memory is a lane"; FACTS.md H200: 3.1 G
              params/s in the engine against 8.4 measured on a warm buffer):
                t = call + max(n * kernel_bytes/28 / compute, n * bus_bytes / (eff * host_bw))
                    / kernel factor + separate cast passes
              bus_bytes = kernel bytes (28 - 2 bf16 grad in + 2 bf16 copy out - 8 bf16
              moments) + the write-allocate read of the write-only bf16 copy (x86) + the
              bucket's D2H and H2D bytes
  bf16 moments m and v stored as bf16 with stochastic rounding (OffloadConfig.
              optimizer_state_dtype="bf16"; docs/kernel.md "Reduced precision"): 2 + 2 B read
              and 2 + 2 B written instead of 4 + 4 each, so 8 B/param fewer on the bus (28 ->
              20 for the fp32 step); the pass's compute time grows by 1 / the profile's
              cpu_adam_bf16_moments_relative (docs/kernel.md: ~1.3 vs ~3 G params/s per
              thread in cache), so it pays only where the bus, not the cores, bounds the lane
  device Adam fused: t = launch per bucket + params * 28 B / device_bw; the unfused
              foreach step: ~20 launches per bucket and ~118 B/param
  compute     t = FLOPs / achieved FLOP/s (FLOPs from ModelShape: 6 N tokens + attention,
              + 2 N tokens recompute with checkpointing)
  casting     device: launch + elems / device_cast_rate; host: elems / host_cast_rate, a
              separate pass unless the CPU kernel fuses it [§4.4 Superchip-aware casting]
  weight flow efficiency = compute / (compute + exposed transfer),
              exposed = max(0, fetch - compute) per layer [§4.5 adaptive weight offloading]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from superoffload.config import choices_of
from superoffload.plan.compute import layer_times
from superoffload.plan.hardware import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.threads import optimizer_threads, runtime_threads

Kernel = Literal["ours", "deepspeed", "torch"]
KERNELS: tuple[str, ...] = get_args(Kernel)
Direction = Literal["h2d", "d2h"]
STATE_DTYPES: tuple[str, ...] = choices_of("optimizer_state_dtype")
"""OffloadConfig.optimizer_state_dtype: the dtype of the host's Adam moments."""
BF16_MOMENT_SAVING = 8.0
"""Bytes per parameter bf16 moments save in the CPU step: m and v read and written as 2 B
instead of 4 (DESIGN.md §4: 28 -> 20 B/param; docs/kernel.md)."""


def _interp_log(table: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of y over log(x), clamped at both ends."""
    pts = sorted(table)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            # Over log(size): link rates rise with the message size roughly logarithmically
            # between the latency-bound and the saturated regime.
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]  # pragma: no cover - unreachable with a sorted table


def _link(prof: HardwareProfile, direction: Direction
          ) -> tuple[tuple[tuple[float, float], ...], float]:
    """(measured table, peak GB/s) of one link direction."""
    if direction == "h2d":
        return prof.h2d_table, prof.h2d_gbps
    # Anything but "h2d" is the device-to-host direction, as the callers always name one.
    return prof.d2h_table, prof.d2h_gbps


def link_time_s(nbytes: float, prof: HardwareProfile, direction: Direction) -> float:
    """Seconds to move one message of `nbytes` in `direction` ("h2d" or "d2h")."""
    if nbytes <= 0:
        return 0.0
    table, peak = _link(prof, direction)
    if table:
        # A measured table's rates already include the per-message latency.
        return nbytes / (_interp_log(table, nbytes) * 1e9)
    return prof.link_latency_s + nbytes / (peak * 1e9)


def link_time_s_array(nbytes: np.ndarray, prof: HardwareProfile,
                      direction: Direction) -> np.ndarray:
    """`link_time_s` over an array of message sizes (vectorised; 0 bytes take 0 s)."""
    nbytes = np.asarray(nbytes, dtype=float)
    table, peak = _link(prof, direction)
    if table:
        pts = sorted(table)
        xs = np.log([p[0] for p in pts])
        # np.interp clamps at both ends like _interp_log; the 1-byte floor keeps log() finite
        # for the empty messages np.where zeroes below.
        gbps = np.interp(np.log(np.maximum(nbytes, 1.0)), xs, [p[1] for p in pts])
        return np.where(nbytes > 0, nbytes / (gbps * 1e9), 0.0)
    return np.where(nbytes > 0, prof.link_latency_s + nbytes / (peak * 1e9), 0.0)


def link_gbps(nbytes: float, prof: HardwareProfile, direction: Direction) -> float:
    """Effective bandwidth for a message of `nbytes` (GB/s)."""
    return nbytes / link_time_s(nbytes, prof, direction) / 1e9


def cpu_threads(prof: HardwareProfile, cpu_threads_cfg: int | None, cores_frac: float) -> int:
    """Threads of the CPU optimizer on `prof`'s cores: the one thread rule (superoffload.threads:
    the config's `cpu_threads` capped at the cores, else floor(frac * cores), never the cores
    of the runtime's busy threads on a GPU host), >= 1."""
    return optimizer_threads(prof.cpu_cores, cores_frac, explicit=cpu_threads_cfg,
                             reserved=runtime_threads(prof.device_type))


def host_bus_bps(prof: HardwareProfile) -> float:
    """Bytes per second the host's memory bus carries for the offload pipeline (the lane's
    capacity): eff x host_mem_bw_gbps."""
    return prof.cpu_adam_bw_efficiency * prof.host_mem_bw_gbps * 1e9


def cpu_adam_rate(prof: HardwareProfile, threads: int, kernel: Kernel = "ours") -> float:
    """fp32 Adam parameters per second with `threads` threads: the kernel's compute rate,
    capped by the host bus at 28 B/param (also when a measured table exists: a table measured
    on a warm buffer is cache speed, FACTS.md H200), times the kernel factor."""
    rate = cpu_compute_rate(prof, threads)
    # The bus cap applies to the fp32 step's 28 B (§4.6: the CPU step is bandwidth bound).
    return min(rate, host_bus_bps(prof) / ADAM_BYTES_PER_PARAM) * kernel_factor(prof, kernel)


def kernel_factor(prof: HardwareProfile, kernel: Kernel) -> float:
    """Throughput of `kernel` relative to ours (FACTS.md Grace figures)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    return {"ours": 1.0, "deepspeed": prof.deepspeed_adam_relative,
            "torch": prof.torch_adam_relative}[kernel]


def cpu_compute_rate(prof: HardwareProfile, threads: int) -> float:
    """Our kernel's params/s with `threads` threads before any bandwidth cap: the measured
    table (interpolated, saturating past its last point) or threads x per-core rate."""
    if prof.cpu_adam_table:
        pts = sorted(prof.cpu_adam_table)
        if threads <= pts[0][0]:
            # Below the first row: linear in the threads (each core runs its own share).
            rate = pts[0][1] * threads / pts[0][0]
        elif threads >= pts[-1][0]:
            # measured saturation; more threads than measured adds nothing
            rate = pts[-1][1]
        else:
            rate = pts[-1][1]
            for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
                if t0 <= threads <= t1:
                    rate = r0 + (threads - t0) / (t1 - t0) * (r1 - r0)
                    break
    else:
        rate = threads * prof.cpu_adam_params_per_s_per_core
    return rate


def cpu_adam_time_s(params: float, prof: HardwareProfile, threads: int, kernel: Kernel = "ours",
                    bytes_per_param: float = ADAM_BYTES_PER_PARAM) -> float:
    """One CPU Adam call over `params` parameters touching `bytes_per_param` each."""
    if params <= 0:
        return 0.0
    # The rate is per fp32 28 B step; a variant touching other bytes scales with them (the
    # step is bandwidth bound).
    return prof.cpu_call_s + params / cpu_adam_rate(prof, threads, kernel) * (
        bytes_per_param / ADAM_BYTES_PER_PARAM
    )


UNFUSED_TAIL_BYTES = 118.0
"""Device bytes per parameter of the unfused tail step (``ENGINE_H200_MEASURED``'s
kernels.device_adam_multi: ~13 foreach passes, per-tensor casts and temporaries)."""
UNFUSED_TAIL_LAUNCHES = 20
"""Kernel launches per tail bucket of the unfused tail step (``ENGINE_H200_MEASURED``)."""
FUSED_TAIL_LAUNCHES = 1
"""A fused multi-tensor step (``torch._fused_adamw_`` or one Triton kernel): one per bucket."""


def device_adam_time_s(params: float, prof: HardwareProfile, *, tail_step: str = "fused",
                       buckets: int = 1) -> float:
    """Device Adam over `params` parameters in `buckets` buckets: "fused" is bandwidth bound at
    28 B/param (read bf16 grad + fp32 p, m, v; write p, m, v + the bf16 copy) with one launch
    per bucket; "unfused" is ``ENGINE_H200_MEASURED``'s foreach step, 118 B/param and 20
    launches per bucket."""
    if params <= 0:
        return 0.0
    if tail_step == "fused":
        per_param, launches = float(ADAM_BYTES_PER_PARAM), FUSED_TAIL_LAUNCHES
    elif tail_step == "unfused":
        per_param, launches = UNFUSED_TAIL_BYTES, UNFUSED_TAIL_LAUNCHES
    else:
        raise ValueError(f"tail_step={tail_step!r}: use 'fused' or 'unfused'")
    # At least one launch: a tail with parameters is stepped even when given 0 buckets.
    return (max(1, buckets) * launches * prof.device_launch_s
            + params * per_param / (prof.device_mem_bw_gbps * 1e9))


def tail_bytes_per_param(tail_step: str) -> float:
    """Device bytes per parameter the tail step moves (for calibrate's bandwidth fit)."""
    if tail_step == "fused":
        return float(ADAM_BYTES_PER_PARAM)
    # Anything else is the unfused step: device_adam_time_s rejects other names first.
    return UNFUSED_TAIL_BYTES


def compute_time_s(flops: float, prof: HardwareProfile) -> float:
    """Device time of `flops` at the profile's achieved rate."""
    return flops / (prof.device_achieved_tflops * 1e12)


def device_cast_time_s(elems: float, prof: HardwareProfile) -> float:
    if elems <= 0:
        # Nothing to cast launches no kernel: no launch cost either.
        return 0.0
    return prof.device_launch_s + elems / (prof.device_cast_gelems * 1e9)


def host_cast_time_s(elems: float, prof: HardwareProfile) -> float:
    if elems <= 0:
        return 0.0
    # No launch term: the host pass is a plain loop in the calling thread.
    return elems / (prof.host_cast_gelems * 1e9)


# ----------------------------------------------------------------------------- casting (§4.4)
def kernel_fuses(kernel: Kernel) -> tuple[bool, bool]:
    """(reads bf16 gradients in its pass, writes the bf16 weight copy in its pass).
    Ours does both (kernels.adam_step_multi casts grads and fills params_lp); DeepSpeed's
    CPUAdam fuses the low-precision copy only; torch's optimizer fuses neither."""
    return {"ours": (True, True), "deepspeed": (False, True), "torch": (False, False)}[kernel]


@dataclass(frozen=True, slots=True)
class HostStep:
    """Per-parameter costs of one offloaded parameter on the host side (the host lane)."""

    kernel_bytes: float
    """Bytes the CPU kernel pass touches: 28, - 2 reading a bf16 gradient, + 2 writing the
    bf16 copy, - 8 with bf16 moments (DESIGN.md §4)."""
    bus_bytes: float
    """Bytes crossing the host memory bus for it: kernel bytes, the write-allocate read of
    the write-only bf16 copy (x86), the D2H and H2D (or weight-flow fetch) bytes."""
    cast_bytes: float
    """Bus bytes of separate cast passes (kernels that do not fuse the cast)."""
    cast_s: float
    """Seconds of separate cast passes at the host cast rate."""
    g_bytes: float
    """Link bytes of the gradient (4 fp32, 2 bf16)."""
    p_bytes: float
    """Link bytes of the updated weight."""
    compute_scale: float = 1.0
    """The kernel pass's compute time per parameter in units of the fp32 28 B step at the
    profile's compute rate: kernel_bytes / 28 with fp32 moments; (kernel_bytes + 8) / 28 /
    cpu_adam_bf16_moments_relative with bf16 moments (module docstring, "bf16 moments")."""


def host_step(prof: HardwareProfile, grad_cast: str, param_cast: str, kernel: Kernel, *,
              flow: bool = False, moments: str = "fp32") -> HostStep:
    """The host lane's bytes for one casting choice (module docstring, "host lane").
    grad "device": the device casts to fp32 and 4 B cross; "host": 2 B cross and the kernel
    reads bf16 (or a separate pass widens them). param "host": the kernel writes the bf16
    copy and 2 B cross; "device": 4 B fp32 cross. With weight-flow no bucket H2D happens;
    each weight streams in twice per iteration (forward and backward, §4.5). ``moments``:
    "fp32" or "bf16" (OffloadConfig.optimizer_state_dtype; 8 B fewer, slower compute)."""
    if moments not in STATE_DTYPES:
        raise ValueError(f"optimizer_state_dtype={moments!r}: use one of {STATE_DTYPES}")
    fuse_g, fuse_p = kernel_fuses(kernel)
    # x86 reads each line of a write-only destination before writing it (write-allocate).
    wa = 1.0 if prof.host_write_allocate else 0.0
    kernel_bytes, extra, cast_bytes, cast_s = float(ADAM_BYTES_PER_PARAM), 0.0, 0.0, 0.0
    if grad_cast == "host":
        if fuse_g:
            kernel_bytes -= 2.0
        else:
            # a pass reading 2 B and writing 4 B (allocated first on x86)
            cast_bytes += 6.0 + 4.0 * wa
            cast_s += 1.0 / (prof.host_cast_gelems * 1e9)
    if param_cast == "host":
        if fuse_p:
            kernel_bytes += 2.0
            # the bf16 copy is write-only: its lines are read first
            extra += 2.0 * wa
        else:
            # a pass reading 4 B and writing 2 B
            cast_bytes += 6.0 + 2.0 * wa
            cast_s += 1.0 / (prof.host_cast_gelems * 1e9)
    # Taken before the bf16 saving: compute follows the fp32 pass's bytes (HostStep).
    compute_scale = kernel_bytes / ADAM_BYTES_PER_PARAM
    if moments == "bf16":
        # the same pass with narrower moments: fewer bytes, more compute
        compute_scale /= prof.cpu_adam_bf16_moments_relative
        kernel_bytes -= BF16_MOMENT_SAVING
    # A device-side cast means fp32 crosses the link (4 B); a host-side one, bf16 (2 B).
    g_bytes = 4.0 if grad_cast == "device" else 2.0
    p_bytes = 4.0 if param_cast == "device" else 2.0
    if flow:
        # weight flow: no bucket H2D, the bf16 weight is fetched twice (forward, backward; §4.5)
        h2d_bytes = 2.0 * 2.0
    else:
        h2d_bytes = p_bytes
    dma = g_bytes + h2d_bytes
    return HostStep(kernel_bytes, kernel_bytes + extra + dma, cast_bytes, cast_s, g_bytes,
                    p_bytes, compute_scale)


def host_step_s(params: np.ndarray | float, prof: HardwareProfile, threads: int, kernel: Kernel,
                step: HostStep) -> np.ndarray:
    """Seconds of the CPU lane over `params` parameters (no per-call cost): the kernel pass at
    the slower of its compute rate (times the kernel factor) and the shared bus, plus
    separate cast passes at the slower of the cast rate and the bus."""
    n = np.asarray(params, dtype=float)
    bus = host_bus_bps(prof)
    compute = cpu_compute_rate(prof, threads) * kernel_factor(prof, kernel)
    # The lane runs at its slower resource: the cores or the bus it shares with the DMAs.
    per_kernel = max(step.compute_scale / compute, step.bus_bytes / bus)
    per_cast = max(step.cast_s, step.cast_bytes / bus)
    return n * (per_kernel + per_cast)


def per_param_lane_s(prof: HardwareProfile, grad_cast: str, param_cast: str, kernel: Kernel,
                     threads: int, bucket_params: float, moments: str = "fp32"
                     ) -> dict[str, float]:
    """Seconds per parameter on each lane of the offload pipeline for one casting choice; the
    CPU lane shares the host bus with both DMA directions (`host_step`)."""
    step = host_step(prof, grad_cast, param_cast, kernel, moments=moments)
    # Link times at the bucket's message size (latency amortised over it); >= 1 parameter so
    # an empty bucket does not divide by zero.
    n = max(bucket_params, 1.0)
    return {
        "d2h": link_time_s(step.g_bytes * n, prof, "d2h") / n,
        "cpu": float(host_step_s(1.0, prof, threads, kernel, step)),
        "h2d": link_time_s(step.p_bytes * n, prof, "h2d") / n,
        "adam_bytes": step.kernel_bytes,
        "bus_bytes": step.bus_bytes + step.cast_bytes,
    }


PARAM_CAST_PREFERENCE = ("host", "device")
"""``param_cast``'s decided values in the order ``choose_casting`` and ``plan.tune`` try them:
host casting first (§4.4: the Superchip casts the weights on the host). A search order, not the
``CastSide`` declaration's order; kept as it was so that a tie the tuner breaks by position
(equal preference and equal score) still falls the same way. Its members are the config's
(tests/test_plan_schedule.py)."""


def choose_casting(prof: HardwareProfile, kernel: Kernel, threads: int,
                   bucket_params: float, moments: str = "fp32") -> tuple[str, str, str]:
    """Pick (grad_cast, param_cast) minimising the offload pipeline's bottleneck lane (its
    steady-state throughput), ties broken by the sum (its latency). The CPU lane includes
    the host bus it shares with both DMA directions, so moving fp32 costs host bandwidth
    too (FACTS.md H200: the bus, not the link, bounds the pipeline). Returns a reason too."""
    candidates = []
    for g in choices_of("grad_cast", decided=True):
        for p in PARAM_CAST_PREFERENCE:
            lanes = per_param_lane_s(prof, g, p, kernel, threads, bucket_params, moments)
            key = max(lanes["d2h"], lanes["cpu"], lanes["h2d"])
            total = lanes["d2h"] + lanes["cpu"] + lanes["h2d"]
            candidates.append((key, total, g, p))
    # Tuples compare by bottleneck, then total, then grad_cast's declared order and
    # PARAM_CAST_PREFERENCE's position: ties fall deterministically.
    key, _, g, p = min(candidates)
    reason = (f"grads cast on the {g}, weights cast on the {p}: the slowest pipeline lane then "
              f"costs {key * 1e12:.1f} ps/param")
    return g, p, reason


# ----------------------------------------------------------------------------- weight flow (§4.5)
def weight_flow_efficiency(shape: ModelShape, prof: HardwareProfile) -> float:
    """compute / (compute + exposed transfer) when every layer's bf16 weights stream in before
    its forward and again before its backward, each fetch hidden behind the previous layer's
    compute."""
    params = shape.layer_params()
    fwd, bwd = layer_times(shape, prof)
    compute = sum(fwd) + sum(bwd)
    exposed = 0.0
    for p, tf, tb in zip(params, fwd, bwd):
        # 2 B per parameter: the bf16 weights
        fetch = link_time_s(2.0 * p, prof, "h2d")
        exposed += max(0.0, fetch - tf) + max(0.0, fetch - tb)
    if compute + exposed > 0:
        return compute / (compute + exposed)
    # An empty model: nothing to hide, so nothing is exposed.
    return 1.0
