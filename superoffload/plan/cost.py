"""Cost model: the time of each piece of work, from a HardwareProfile (DESIGN.md §5).

Formulas (paper section in brackets; SuperOffload, Lian et al., arXiv 2509.21271):
  link        t = latency + bytes / peak            per direction, per message; with a measured
                                                    table, t = bytes / bw(bytes) (log-interpolated)
                                                    [§4.2: ~64 MB buckets saturate NVLink-C2C]
  CPU Adam    t = call + params / rate(threads) * bytes_per_param / 28
              rate(threads) = min(threads * per_core, eff * host_bw / 28 B) x kernel factor
                                                    [§4.6 GraceAdam: memory-bandwidth bound]
  device Adam t = launch + params * 28 B / device_bw
  compute     t = FLOPs / achieved FLOP/s           (FLOPs from ModelShape: 6 N tokens + attention,
                                                    + 2 N tokens recompute with checkpointing)
  casting     device: launch + elems / device_cast_rate; host: elems / host_cast_rate, a separate
              pass unless the CPU kernel fuses it       [§4.4 Superchip-aware casting]
  weight flow efficiency = compute / (compute + exposed transfer), exposed = max(0, fetch - compute)
              per layer                             [§4.5 adaptive weight offloading]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from superoffload.plan.profiles import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.shapes import ModelShape

Kernel = Literal["ours", "deepspeed", "torch"]
KERNELS: tuple[str, ...] = ("ours", "deepspeed", "torch")
Direction = Literal["h2d", "d2h"]


def _interp_log(table: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of y over log(x), clamped at both ends."""
    pts = sorted(table)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]  # pragma: no cover - unreachable with a sorted table


def link_time_s(nbytes: float, prof: HardwareProfile, direction: Direction) -> float:
    """Seconds to move one message of `nbytes` in `direction` ("h2d" or "d2h")."""
    if nbytes <= 0:
        return 0.0
    table = prof.h2d_table if direction == "h2d" else prof.d2h_table
    if table:
        return nbytes / (_interp_log(table, nbytes) * 1e9)
    peak = prof.h2d_gbps if direction == "h2d" else prof.d2h_gbps
    return prof.link_latency_s + nbytes / (peak * 1e9)


def link_time_s_array(nbytes: np.ndarray, prof: HardwareProfile, direction: Direction) -> np.ndarray:
    """`link_time_s` over an array of message sizes (vectorised; 0 bytes take 0 s)."""
    nbytes = np.asarray(nbytes, dtype=float)
    table = prof.h2d_table if direction == "h2d" else prof.d2h_table
    if table:
        pts = sorted(table)
        xs = np.log([p[0] for p in pts])
        gbps = np.interp(np.log(np.maximum(nbytes, 1.0)), xs, [p[1] for p in pts])
        return np.where(nbytes > 0, nbytes / (gbps * 1e9), 0.0)
    peak = prof.h2d_gbps if direction == "h2d" else prof.d2h_gbps
    return np.where(nbytes > 0, prof.link_latency_s + nbytes / (peak * 1e9), 0.0)


def link_gbps(nbytes: float, prof: HardwareProfile, direction: Direction) -> float:
    """Effective bandwidth for a message of `nbytes` (GB/s)."""
    return nbytes / link_time_s(nbytes, prof, direction) / 1e9


def cpu_threads(prof: HardwareProfile, cpu_threads_cfg: int | None, cores_frac: float) -> int:
    """Threads of the CPU optimizer: the config's `cpu_threads`, else floor(frac * cores), >= 1."""
    if cpu_threads_cfg is not None:
        return max(1, min(cpu_threads_cfg, prof.cpu_cores))
    return max(1, math.floor(cores_frac * prof.cpu_cores))


def cpu_adam_rate(prof: HardwareProfile, threads: int, kernel: Kernel = "ours") -> float:
    """fp32 Adam parameters per second with `threads` threads."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    if prof.cpu_adam_table:
        pts = sorted(prof.cpu_adam_table)
        if threads <= pts[0][0]:
            rate = pts[0][1] * threads / pts[0][0]
        elif threads >= pts[-1][0]:
            rate = pts[-1][1]  # measured saturation; more threads than measured adds nothing
        else:
            rate = pts[-1][1]
            for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
                if t0 <= threads <= t1:
                    rate = r0 + (threads - t0) / (t1 - t0) * (r1 - r0)
                    break
    else:
        cap = prof.cpu_adam_bw_efficiency * prof.host_mem_bw_gbps * 1e9 / ADAM_BYTES_PER_PARAM
        rate = min(threads * prof.cpu_adam_params_per_s_per_core, cap)
    factor = {"ours": 1.0, "deepspeed": prof.deepspeed_adam_relative,
              "torch": prof.torch_adam_relative}[kernel]
    return rate * factor


def cpu_adam_time_s(params: float, prof: HardwareProfile, threads: int, kernel: Kernel = "ours",
                    bytes_per_param: float = ADAM_BYTES_PER_PARAM) -> float:
    """One CPU Adam call over `params` parameters touching `bytes_per_param` each."""
    if params <= 0:
        return 0.0
    return prof.cpu_call_s + params / cpu_adam_rate(prof, threads, kernel) * (
        bytes_per_param / ADAM_BYTES_PER_PARAM
    )


def device_adam_time_s(params: float, prof: HardwareProfile) -> float:
    """A fused device Adam over `params` parameters: bandwidth bound at 28 B/param."""
    if params <= 0:
        return 0.0
    return prof.device_launch_s + params * ADAM_BYTES_PER_PARAM / (prof.device_mem_bw_gbps * 1e9)


def compute_time_s(flops: float, prof: HardwareProfile) -> float:
    """Device time of `flops` at the profile's achieved rate."""
    return flops / (prof.device_achieved_tflops * 1e12)


def device_cast_time_s(elems: float, prof: HardwareProfile) -> float:
    return 0.0 if elems <= 0 else prof.device_launch_s + elems / (prof.device_cast_gelems * 1e9)


def host_cast_time_s(elems: float, prof: HardwareProfile) -> float:
    return 0.0 if elems <= 0 else elems / (prof.host_cast_gelems * 1e9)


# ----------------------------------------------------------------------------- casting (§4.4)
def kernel_fuses(kernel: Kernel) -> tuple[bool, bool]:
    """(reads bf16 gradients in its pass, writes the bf16 weight copy in its pass).
    Ours does both (kernels.adam_step_multi casts grads and fills params_lp); DeepSpeed's
    CPUAdam fuses the low-precision copy only; torch's optimizer fuses neither."""
    return {"ours": (True, True), "deepspeed": (False, True), "torch": (False, False)}[kernel]


def per_param_lane_s(prof: HardwareProfile, grad_cast: str, param_cast: str, kernel: Kernel,
                     threads: int, bucket_params: float) -> dict[str, float]:
    """Seconds per parameter on each lane of the offload pipeline for one casting choice.
    grad "device": cast to fp32 on the device, send 4 B; "host": send 2 B, cast on the CPU.
    param "host": the CPU writes bf16, send 2 B; "device": send 4 B fp32, cast on the device."""
    fuse_g, fuse_p = kernel_fuses(kernel)
    adam_bytes = float(ADAM_BYTES_PER_PARAM)
    cpu_extra = 0.0
    if grad_cast == "host":
        if fuse_g:
            adam_bytes -= 2.0  # reads a bf16 instead of an fp32 gradient
        else:
            cpu_extra += host_cast_time_s(1.0, prof)
    if param_cast == "host":
        if fuse_p:
            adam_bytes += 2.0  # writes the bf16 copy in the same pass
        else:
            cpu_extra += host_cast_time_s(1.0, prof)
    g_bytes = 4.0 if grad_cast == "device" else 2.0
    p_bytes = 4.0 if param_cast == "device" else 2.0
    n = max(bucket_params, 1.0)
    return {
        "d2h": link_time_s(g_bytes * n, prof, "d2h") / n,
        "cpu": cpu_extra + adam_bytes / ADAM_BYTES_PER_PARAM / cpu_adam_rate(prof, threads, kernel),
        "h2d": link_time_s(p_bytes * n, prof, "h2d") / n,
        "adam_bytes": adam_bytes,
    }


def choose_casting(prof: HardwareProfile, kernel: Kernel, threads: int,
                   bucket_params: float) -> tuple[str, str, str]:
    """Pick (grad_cast, param_cast) minimising the offload pipeline's bottleneck lane (its
    steady-state throughput), ties broken by the sum (its latency). Returns a reason too."""
    candidates = []
    for g in ("device", "host"):
        for p in ("host", "device"):
            lanes = per_param_lane_s(prof, g, p, kernel, threads, bucket_params)
            key = max(lanes["d2h"], lanes["cpu"], lanes["h2d"])
            total = lanes["d2h"] + lanes["cpu"] + lanes["h2d"]
            candidates.append((key, total, g, p))
    key, _, g, p = min(candidates)
    reason = (f"grads cast on the {g}, weights cast on the {p}: the slowest pipeline lane then "
              f"costs {key * 1e12:.1f} ps/param")
    return g, p, reason


# ----------------------------------------------------------------------------- weight flow (§4.5)
def weight_flow_efficiency(shape: ModelShape, prof: HardwareProfile) -> float:
    """compute / (compute + exposed transfer) when every layer's bf16 weights stream in before its
    forward and again before its backward, each fetch hidden behind the previous layer's compute."""
    params = shape.layer_params()
    fwd = [compute_time_s(f, prof) for f in shape.layer_forward_flops()]
    bwd = [compute_time_s(f, prof) for f in shape.layer_backward_flops()]
    compute = sum(fwd) + sum(bwd)
    exposed = 0.0
    for p, tf, tb in zip(params, fwd, bwd):
        fetch = link_time_s(2.0 * p, prof, "h2d")
        exposed += max(0.0, fetch - tf) + max(0.0, fetch - tb)
    return compute / (compute + exposed) if compute + exposed > 0 else 1.0
