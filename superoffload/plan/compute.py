"""The device-compute lane: seconds of each layer's forward and backward.

Three terms per layer (shapes: plan/formulas.py; rates: the HardwareProfile):
  matmuls      FLOPs / device_achieved_tflops
  element-wise bytes / device_nongemm_gbps: norms, residual adds, activations, the attention
               core, MoE dispatch -- passes bound by memory bandwidth, not FLOPs
               (0 GB/s = not modelled: a preset's achieved TFLOPS already covers them)
  dispatch     operations x device_op_s: Python, autograd and the launch of each operation
               (0 = not modelled). On a GPU the host issues kernels ahead of the device, so
               the layer takes max(device work, dispatch); on the CPU backend one thread does
               both, so they add (a 121 K-parameter model on a CPU is all dispatch: without
               this term its predictions were measured 5-27x too fast).
Backward moves 2x the element-wise bytes and issues 2x the operations of the forward;
activation checkpointing adds one forward of each block (Narayanan et al. 2021, §5.1).

``calibrate`` scales all three by one factor to a measured run (``scaled``), so the split
measured on the machine (plan/probe.py) is kept and the total matches the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.shapes import ModelShape


@dataclass(frozen=True, slots=True)
class ComputeParts:
    """Seconds of one iteration's forward + backward by term (before the GPU's max())."""

    matmul_s: float
    elementwise_s: float
    dispatch_s: float


def _terms(shape: ModelShape, prof: HardwareProfile
           ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """(matmul s, element-wise s, dispatch s) per layer, forward and backward."""
    rate = prof.device_achieved_tflops * 1e12
    bw = prof.device_nongemm_gbps * 1e9
    op = prof.device_op_s
    rec = 1.0 if shape.activation_checkpointing else 0.0
    fwd_f, bwd_f = shape.layer_forward_flops(), shape.layer_backward_flops()
    fwd_b, ops = shape.layer_forward_bytes(), shape.layer_forward_ops()
    last = len(fwd_f) - 1
    fwd, bwd = [], []
    for i, (ff, bf, b, n) in enumerate(zip(fwd_f, bwd_f, fwd_b, ops)):
        # blocks are recomputed, not the edges (embedding, head)
        again = rec if 0 < i < last else 0.0
        # backward: twice forward's element-wise traffic and operations, + one forward when
        # the block is recomputed (the FLOPs come with the shape's backward FLOPs)
        bwd_factor = 2.0 + again
        if bw > 0:
            fwd_elem, bwd_elem = b / bw, bwd_factor * b / bw
        else:
            # a profile without an element-wise rate leaves those passes out
            fwd_elem = bwd_elem = 0.0
        fwd.append((ff / rate, fwd_elem, n * op))
        bwd.append((bf / rate, bwd_elem, bwd_factor * n * op))
    return fwd, bwd


def _combine(term: tuple[float, float, float], device_type: str) -> float:
    work = term[0] + term[1]
    if device_type == "cpu":
        # the CPU backend runs each op on the thread that dispatches it: the costs add
        return work + term[2]
    # a GPU queues launches ahead of its kernels: dispatch overlaps the work
    return max(work, term[2])


def layer_times(shape: ModelShape, prof: HardwareProfile) -> tuple[list[float], list[float]]:
    """Seconds of each layer's forward and backward, forward order (module docstring)."""
    fwd, bwd = _terms(shape, prof)
    return ([_combine(t, prof.device_type) for t in fwd],
            [_combine(t, prof.device_type) for t in bwd])


def parts(shape: ModelShape, prof: HardwareProfile) -> ComputeParts:
    """The iteration's forward + backward seconds by term."""
    fwd, bwd = _terms(shape, prof)
    both = fwd + bwd
    return ComputeParts(sum(t[0] for t in both), sum(t[1] for t in both),
                        sum(t[2] for t in both))


def iteration_compute_s(shape: ModelShape, prof: HardwareProfile) -> float:
    """Forward + backward seconds of one iteration on the device lane."""
    fwd, bwd = layer_times(shape, prof)
    return sum(fwd) + sum(bwd)


def scaled(prof: HardwareProfile, factor: float, source: str) -> HardwareProfile:
    """`prof` with every compute term `factor` times faster (rates x factor, per-op cost /
    factor): the lane's time divides by `factor`, its split stays."""
    sources = dict(prof.sources)
    sources["device_achieved_tflops"] = source
    tflops = prof.device_achieved_tflops * factor
    return prof.replace(device_achieved_tflops=tflops,
                        device_peak_tflops=max(prof.device_peak_tflops, tflops),
                        device_nongemm_gbps=prof.device_nongemm_gbps * factor,
                        device_op_s=prof.device_op_s / factor, sources=tuple(sources.items()))
