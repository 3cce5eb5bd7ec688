"""The peer users actually run: DeepSpeed ZeRO-2 with ``offload_optimizer: {device: cpu}``.

The planner's "zero-offload" system. Modelled from DeepSpeed's own code (its ZeRO stage 1/2
optimizer and its ZeRO config defaults, DeepSpeed 0.19.8), not from the ZeRO-Offload paper's
description, because FACTS.md measured DeepSpeed 0.19.8 at 746.6 ms where the paper-style
model said 484.

What one iteration does (dp ranks; DS = DeepSpeed's ZeRO stage 1/2 code):
  backward   gradients gather in "ipg" reduce buckets of ``reduce_bucket_size`` elements
             (DS config default 5e8; whole parameters, a larger one alone). When a bucket is
             full (``reduce_independent_p_g_buckets_and_remove_grads``) it is reduced
             (``average_tensor``: reduce-scatter in the model dtype; nothing at dp=1) and, per
             parameter of this rank's partition (``copy_grads_in_partition`` with cpu_offload):
             ``.double().norm(2)`` on the GPU, ``_has_inf_or_nan`` tested with a Python ``if``
             (a host sync per parameter), ``.to(fp32)`` on the GPU and a pinned fp32 D2H copy
             (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``). ZeRO-2's ``overlap_comm``
             defaults to False (DS config ``overlap_comm_valid``: True only for stage 3), so
             all of it runs on the compute stream: backward waits for it.
  step       ``complete_grad_norm_calculation_for_cpu_offload``: one ``.item()`` per
             parameter; ``unscale_and_clip_grads``: ``mul_`` over the fp32 gradient partition
             on the CPU even at scale 1 (8 B/param); DeepSpeedCPUAdam over the fp32 partition
             (28 B/param); ``bit16_partition_buffer.copy_(fp32_partition)``: a CPU cast into a
             pinned bf16 buffer; its non-blocking H2D; ``all_gather_dp_groups`` (dp > 1).
             The next forward is queued behind the H2D on the same stream.
Device memory: the flat bf16 parameters (2 B/param, every rank), the contiguous ipg bucket
buffer (``setup_buckets``: ``reduce_bucket_size`` elements of the model dtype, two with
overlap_comm), ``temp_grad_buffer_for_gpu_offload`` (largest parameter), the per-parameter
temporaries of the gradient processing (fp32 and fp64 copies, the autograd gradient), the
activations.
Host, as DeepSpeed allocates it with ``offload_optimizer.pin_memory`` (the paper's setting,
FACTS.md): the fp32 master partition, its fp32 gradient (``initialize_optimizer_states``)
and the bf16 partition buffer are each one pinned tensor, pinned through ``tensor.pin_memory()``
(the accelerator's default, unless ``DS_PIN_MEMORY_BACKEND=native``), and PyTorch's pinned-host
caching allocator rounds every allocation up to a power of two before asking the driver
(``CachingHostAllocator``: ``PowerOf2Ceil(size)``); DeepSpeedCPUAdam's m and v are
``zeros_like`` the partition at the first step: pageable, exact. So the host holds
2 x pow2(4 n) + pow2(2 n) + 8 n (+ pow2 of ``temp_grad_buffer_for_cpu_offload``, the largest
parameter in the model dtype) for a partition of n parameters: 18 B/param just below a power
of two, up to 26 just above one. Learned from the code, nothing copied (DESIGN.md: the peer,
modelled).
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np

from superoffload.config import OffloadConfig
from superoffload.plan import compute, cost, parallel
from superoffload.plan.buckets import plan_buckets
from superoffload.plan.hardware import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.memory_types import Memory
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.telemetry import events as ev

REDUCE_BUCKET_ELEMS = 500_000_000
"""``reduce_bucket_size`` default (DeepSpeed's ZeRO config)."""
OVERLAP_COMM = False
"""ZeRO-2's default (DeepSpeed config ``overlap_comm_valid``: only stage 3 defaults to True)."""
GRAD_PASS_BYTES = 56.0
"""Device bytes per gradient element of the per-parameter processing: the copy into the ipg
buffer (2 + 2), ``.double().norm(2)`` (2 + 8 + 8), ``_has_inf_or_nan`` (float, isnan, isinf,
logical_or, float, max: ~28) and ``.to(fp32)`` (2 + 4)."""
GRAD_PASS_LAUNCHES = 11
"""Kernel launches per parameter of that processing (same list)."""
SYNCS_PER_PARAM = 2
"""Host round trips per parameter: the ``if`` on ``_has_inf_or_nan`` in backward and the
``.item()`` of its norm in the step."""


def resolve_zero2(shape: ModelShape, prof: HardwareProfile, cfg: OffloadConfig,
                  rollback_rate: float) -> Resolved:
    """The schedule DeepSpeed runs: every parameter on the host, reduce buckets of 5e8
    elements, no speculation, gradients cast on the device (fp32 crosses), weights cast on the
    host (bf16 crosses), DeepSpeedCPUAdam on every core of the rank's share."""
    plan = plan_buckets(shape.param_specs(), bucket_bytes=REDUCE_BUCKET_ELEMS * 4, ratio=1.0)
    low = shape.dtype != "float32"
    # DeepSpeedCPUAdam writes the 16-bit copy on the host; an fp32 model has none to cast
    param_cast = "host" if low else "device"
    return Resolved(
        system="zero-offload", bucket_bytes=REDUCE_BUCKET_ELEMS * 4, whole_model_bucket=False,
        ratio=1.0, speculate=False, rollback_rate=rollback_rate, grad_cast="device",
        param_cast=param_cast, weights="stationary", kernel="deepspeed",
        threads=prof.cpu_cores, prefetch_depth=cfg.prefetch_depth, snapshot_rollback=False,
        bucket_plan=plan, requested_ratio=1.0, model_dtype=shape.dtype,
        reasons=("DeepSpeed ZeRO-2 + offload_optimizer (stage_1_and_2.py): gradients processed "
                 "and copied on the compute stream (overlap_comm off), CPU step after backward",))


def zero2_memory(shape: ModelShape, plan: Resolved) -> Memory:
    """Per-rank bytes of DeepSpeed ZeRO-2 + offload_optimizer (module docstring)."""
    n = float(shape.params)
    _, numel = shape.param_layout()
    # the per-parameter gradient passes run on one parameter at a time: the largest bounds them
    largest = float(numel.max()) if len(numel) else 0.0
    w = shape.dtype_bytes
    part = n / shape.dp
    # overlap_comm double-buffers the reduce bucket
    reduce_buffers = 2 if OVERLAP_COMM else 1
    dev = {
        "weights_bf16": w * n,
        "reduce_bucket": min(REDUCE_BUCKET_ELEMS, n) * w * reduce_buffers,
        "grad_temporaries": largest * (w + w + 4.0 + 8.0 + 4.0),
        "activations": shape.activation_bytes(),
    }
    host = {"fp32_master_pinned": pinned_bytes(4.0 * part),
            "fp32_grad_pinned": pinned_bytes(4.0 * part),
            "bf16_buffer_pinned": pinned_bytes(w * part),
            "adam_moments": 8.0 * part,
            "temp_grad_buffer_pinned": pinned_bytes(w * largest)}
    return Memory(sum(dev.values()), sum(host.values()), dev, host)


def pinned_bytes(nbytes: float) -> float:
    """Bytes one pinned allocation of ``nbytes`` takes: PyTorch's pinned-host caching
    allocator rounds it up to a power of two (module docstring)."""
    if nbytes <= 0:
        # log2 is undefined at 0; nothing is allocated
        return 0.0
    return float(2 ** math.ceil(math.log2(nbytes)))


def zero2_run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int
              ) -> tuple[list[float], list]:
    """`n_iter` iterations of DeepSpeed's schedule; (backward ends, span chunks) as
    simulate._run returns them. Everything is serialised (module docstring)."""
    layer, numel = shape.param_layout()
    p = np.asarray(shape.layer_params(), dtype=float)
    fwd_t, bwd_t = compute.layer_times(shape, prof)
    dp = shape.dp
    w = shape.dtype_bytes
    launch = prof.device_launch_s
    # per reduce bucket: reduce-scatter, device passes, per-parameter fp32 D2H of the partition
    buckets = plan.bucket_plan.buckets
    sizes = [len(b.param_indices) for b in buckets]
    members = np.fromiter(chain.from_iterable(b.param_indices for b in buckets), dtype=np.int64,
                          count=sum(sizes))
    # bucket of each member
    of = np.repeat(np.arange(len(buckets)), sizes)
    # this rank's share of each parameter's gradient
    mine = numel[members] / dp
    done_in = np.full(len(buckets), len(p), dtype=np.int64)
    # a bucket completes in its earliest layer: backward reaches it last
    np.minimum.at(done_in, of, layer[members])
    b_numel = np.asarray([b.numel for b in buckets], dtype=float)
    rs = parallel.ring_time_s(b_numel * w, dp, prof)
    dev = (np.asarray(sizes) * (GRAD_PASS_LAUNCHES + SYNCS_PER_PARAM) * launch
           + np.bincount(of, weights=mine, minlength=len(buckets)) * GRAD_PASS_BYTES
           / (prof.device_mem_bw_gbps * 1e9))
    d2h = np.bincount(of, weights=cost.link_time_s_array(mine * 4.0, prof, "d2h"),
                      minlength=len(buckets))
    extra_after_layer = np.bincount(done_in, weights=rs + dev, minlength=len(p))
    d2h_after_layer = np.bincount(done_in, weights=d2h, minlength=len(p))
    d2h_bytes_after = np.bincount(done_in, weights=np.bincount(of, weights=mine * 4.0,
                                                               minlength=len(buckets)),
                                  minlength=len(p))
    part = float(shape.params) / dp
    bus = cost.host_bus_bps(prof)
    # x86 reads a write-only destination's lines first (write-allocate)
    wa = 1.0 if prof.host_write_allocate else 0.0
    # the .item() per parameter: a host sync each
    norm_s = len(numel) * SYNCS_PER_PARAM * launch / 2
    # mul_ in place over the fp32 gradient partition: read and write 4 B each
    unscale_s = part * 8.0 / bus
    rate = cost.cpu_compute_rate(prof, plan.threads) * cost.kernel_factor(prof, "deepspeed")
    adam_s = prof.cpu_call_s + part * max(1.0 / rate, ADAM_BYTES_PER_PARAM / bus)
    # a separate pass: read fp32 (4), write bf16 (2, allocated first on x86)
    cast_s = part * max(1.0 / (prof.host_cast_gelems * 1e9), (6.0 + 2.0 * wa) / bus)
    h2d_s = cost.link_time_s(part * w, prof, "h2d")
    ag_s = float(parallel.ring_time_s(float(shape.params) * w, dp, prof))

    chunks: list = []
    bwd_ends: list[float] = []
    t = 0.0
    for it in range(n_iter):
        f_s, f_e, b_s, b_e, d_s, d_e, d_b, wait_s, wait_e = [], [], [], [], [], [], [], [], []
        for li in range(len(p)):
            f_s.append(t)
            t += fwd_t[li]
            f_e.append(t)
        for li in reversed(range(len(p))):
            b_s.append(t)
            t += bwd_t[li]
            b_e.append(t)
            if extra_after_layer[li] or d2h_after_layer[li]:
                wait_s.append(t)
                t += extra_after_layer[li]
                d_s.append(t)
                # the copies run on the compute stream: backward waits for them
                t += d2h_after_layer[li]
                d_e.append(t)
                d_b.append(int(d2h_bytes_after[li]))
                wait_e.append(t)
        bwd_ends.append(t)
        chunks.append((ev.LANE_COMPUTE, ev.KIND_FORWARD, f_s, f_e, it, None, 0))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_BACKWARD, b_s, b_e, it, None, 0))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_WAIT, wait_s, wait_e, it, None, 0))
        chunks.append((ev.LANE_D2H, ev.KIND_D2H, d_s, d_e, it, None, d_b))
        # the step starts after backward and runs its parts in sequence: the norm's syncs,
        # unscale, Adam, the cast of the 16-bit copy
        s0 = t + norm_s
        a0 = s0 + unscale_s
        a1 = a0 + adam_s
        c1 = a1 + cast_s
        chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, [s0, a0, a1], [a0, a1, c1], it, None,
                       [0, int(part * ADAM_BYTES_PER_PARAM), 0]))
        # the updated partition goes up and is all-gathered before the next forward starts
        h1 = c1 + h2d_s + ag_s
        chunks.append((ev.LANE_H2D, ev.KIND_H2D, [c1], [h1], it, None, int(part * w)))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_WAIT, [t], [h1], it, None, 0))
        t = h1
    return bwd_ends, chunks


def zero2_collective_s(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> float:
    """Per-rank collective seconds of one DeepSpeed iteration: each reduce bucket's
    reduce-scatter in the model dtype (``average_tensor``) and the all-gather of the updated
    bf16 partitions (``all_gather_dp_groups``); 0 at dp=1."""
    w = shape.dtype_bytes
    rs = sum(float(parallel.ring_time_s(b.numel * w, shape.dp, prof))
             for b in plan.bucket_plan.buckets)
    return rs + float(parallel.ring_time_s(float(shape.params) * w, shape.dp, prof))
