"""The lanes of one simulated iteration: the engine's bucket table on the device, link, host
and device-optimizer lanes (DESIGN.md §3, §5; the model: plan/simulate.py's docstring).

Legend: ``numel`` elements of a bucket, ``shard`` this rank's part of it (ZeRO: ceil(numel/dp),
distributed/zero_layout.py), ``*_dur`` seconds per bucket, ``*_free`` when a lane is next free.
Buckets are the engine's (plan.buckets via the rule book): whole parameters in gradient-ready
order, the host ones first. A bucket is complete when the gradient stream (backward, layer by
layer, uniform within a layer) passes its first-registered parameter; a layer's forward needs
the previous iteration's H2D of every host bucket holding one of its parameters.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from superoffload.plan import compute, cost, parallel
from superoffload.plan.profiles import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.telemetry import events as ev

D2H_STATS_LAUNCHES = 9
"""Norm / non-finite kernels ENGINE_TODAY's D2H lane launches per bucket ahead of the copy
(issue 11, item 8); with one bucket in flight it also pays a host round trip (2 launches).
The engine now copies first (EngineVariant.d2h_stats_first=False): none of this."""


def fifo(ready: np.ndarray, dur: np.ndarray, free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Start and end times of jobs served in order by one lane free from `free_s`:
    end_i = max(end_{i-1}, ready_i) + dur_i, in closed form
    end_i = C_i + max(free_s, max_{j<=i}(ready_j - C_{j-1})), C = cumsum(dur)."""
    if len(ready) == 0:
        return ready.copy(), ready.copy()
    c = np.cumsum(dur)
    end = c + np.maximum(np.maximum.accumulate(ready - (c - dur)), free_s)
    return end - dur, end


def edf(ready: np.ndarray, dur: np.ndarray, free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Non-preemptive earliest-deadline-first on one lane: whenever it is free, of the jobs
    ready the one with the highest index runs (bucket ids follow gradient-ready order, the
    reverse of forward order, so the highest id is needed first by the next forward). A heap
    over the jobs: O(n log n) Python steps, the one part of the simulator that is not a
    vectorised scan."""
    n = len(ready)
    r, d = ready.tolist(), dur.tolist()
    start, end = [0.0] * n, [0.0] * n
    t, k = float(free_s), 0
    if n < 2 or bool(np.all(np.diff(ready) >= 0)):
        # arrivals in index order (the D2H lane is FIFO by bucket id): the highest ready
        # index is the latest arrival, so the heap is a stack
        stack: list[int] = []
        for _ in range(n):
            if not stack and r[k] > t:
                t = r[k]
            while k < n and r[k] <= t:
                stack.append(k)
                k += 1
            j = stack.pop()
            start[j] = t
            t += d[j]
            end[j] = t
        return np.asarray(start), np.asarray(end)
    arrival = sorted(range(n), key=lambda i: (r[i], i))
    heap: list[int] = []
    for _ in range(n):
        if not heap and r[arrival[k]] > t:
            t = r[arrival[k]]
        while k < n and r[arrival[k]] <= t:
            heapq.heappush(heap, -arrival[k])
            k += 1
        j = -heapq.heappop(heap)
        start[j] = t
        t += d[j]
        end[j] = t
    return np.asarray(start), np.asarray(end)


@dataclass(frozen=True, slots=True)
class Layout:
    """Static arrays of one (shape, plan): layers and the engine's host buckets."""

    p: np.ndarray
    """Parameters per layer, forward order."""
    off: float
    """Parameters in host buckets."""
    numel: np.ndarray
    """Elements per host bucket (gradient-ready order)."""
    b_hi: np.ndarray
    """Position in the gradient stream where each host bucket is complete."""
    pair_layer: np.ndarray
    pair_bucket: np.ndarray
    """(layer, host bucket) pairs: the layer's forward needs that bucket's weights."""
    has_tail: np.ndarray
    """Per layer: holds a parameter stepped on the device (waits for the tail step)."""
    has_off: np.ndarray
    n_tail_buckets: int


def layout(shape: ModelShape, plan: Resolved) -> Layout:
    """The engine's bucket table of `plan` mapped onto the layers of `shape`."""
    layer, pn = shape.param_layout()
    n_layers = shape.layers + 2
    p = np.bincount(layer, weights=pn, minlength=n_layers).astype(float)
    stream_end = float(p.sum()) - np.concatenate([[0], np.cumsum(pn)[:-1]]).astype(float)
    p_hb = np.full(len(pn), -1, dtype=np.int64)
    host = () if plan.schedule == "gpu" else plan.bucket_plan.host_buckets
    if host:  # host bucket ids are 0..len(host)-1 (plan_buckets offloads a leading run)
        sizes = [len(b.param_indices) for b in host]
        members = np.fromiter(chain.from_iterable(b.param_indices for b in host),
                              dtype=np.int64, count=sum(sizes))
        p_hb[members] = np.repeat(np.arange(len(host), dtype=np.int64), sizes)
    on_host = p_hb >= 0
    if plan.whole_model_bucket and on_host.any():
        p_hb[on_host] = 0  # the ablation without buckets: one transfer and one step
    nb = int(p_hb.max()) + 1 if on_host.any() else 0
    numel = np.bincount(p_hb[on_host], weights=pn[on_host], minlength=nb).astype(float)
    b_hi = np.zeros(nb)
    np.maximum.at(b_hi, p_hb[on_host], stream_end[on_host])
    key = np.unique(layer[on_host] * max(nb, 1) + p_hb[on_host])
    live = pn > 0
    has_off = np.bincount(layer[on_host & live], minlength=n_layers) > 0
    has_tail = np.bincount(layer[~on_host & live], minlength=n_layers) > 0
    n_tail = len(plan.bucket_plan.device_buckets) if plan.schedule != "gpu" else len(
        plan.bucket_plan.buckets)
    return Layout(p, float(numel.sum()), numel, b_hi, key // max(nb, 1), key % max(nb, 1),
                  has_tail, has_off, n_tail)


def collectives(shape: ModelShape, prof: HardwareProfile, plan: Resolved, lay: Layout
                ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(reduce-scatter s per bucket, all-gather s per bucket, tail all-reduce s, validation
    all-reduce s) for one rank; zeros at dp=1. Gradients reduce in fp32 (distributed/zero.py);
    weights gather in the dtype they cross the link in."""
    n = shape.dp
    p_bytes = 4.0 if plan.param_cast == "device" else 2.0
    rs = parallel.ring_time_s(lay.numel * 4.0, n, prof)
    ag = parallel.ring_time_s(lay.numel * p_bytes, n, prof)
    tail_ar = parallel.all_reduce_time_s(4.0 * (float(lay.p.sum()) - lay.off), n, prof)
    val_ar = parallel.all_reduce_time_s(8.0, n, prof)  # [sum of squares, non-finite count]
    return rs, ag, tail_ar, val_ar


Order = Callable[[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray]]


def run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
        clipped_iter: int | None, lay: Layout | None = None) -> tuple[list[float], list]:
    """Simulate `n_iter` iterations; return the backward-end times and the span chunks.
    `lay`: ``layout(shape, plan)`` when the caller has it already."""
    lay = lay if lay is not None else layout(shape, plan)
    p, off, numel, nb = lay.p, lay.off, lay.numel, len(lay.numel)
    n_layers = len(p)
    fwd_t, bwd_t = compute.layer_times(shape, prof)
    total = float(p.sum())
    tail = total - off
    flow = plan.weights == "flow" and off > 0
    low = plan.model_dtype != "float32"
    w_bytes = 2.0 if low else 4.0
    dp = shape.dp
    shard = np.ceil(numel / dp) if dp > 1 else numel  # this rank's slice of each bucket (ZeRO §5)
    step = cost.host_step(prof, plan.grad_cast, plan.param_cast, plan.kernel, flow=flow,
                          moments=plan.optimizer_state_dtype)
    g_bytes, p_bytes = step.g_bytes, step.p_bytes
    d2h_dur = cost.link_time_s_array(shard * g_bytes, prof, "d2h")
    if plan.engine.d2h_stats_first and nb:
        d2h_dur = d2h_dur + (D2H_STATS_LAUNCHES + 2) * prof.device_launch_s
    h2d_dur = cost.link_time_s_array(shard * p_bytes, prof, "h2d")
    adam_dur = cost.host_step_s(shard, prof, plan.threads, plan.kernel, step)
    cpu_dur = prof.cpu_call_s + adam_dur
    dcast = prof.device_launch_s + numel / (prof.device_cast_gelems * 1e9)
    tail_ar = val_ar = 0.0
    home_copy = np.zeros(nb)
    if dp > 1:
        rs, ag, tail_ar, val_ar = collectives(shape, prof, plan, lay)
        d2h_dur = d2h_dur + rs  # reduce-scatter, then the shard's copy: one d2h span
        h2d_dur = h2d_dur + ag  # the shard's copy, then the all-gather: one h2d span
        dcast_shard = prof.device_launch_s + shard / (prof.device_cast_gelems * 1e9)
        if flow and prof.device_type == "cuda":  # the gathered bucket is copied to its home
            home_copy = cost.link_time_s_array(numel * w_bytes, prof, "d2h")
    else:
        dcast_shard = dcast
    pre_d2h = dcast_shard if plan.grad_cast == "device" and low else np.zeros(nb)
    post_h2d = dcast if plan.param_cast == "device" and low else np.zeros(nb)
    fetched = lay.has_off & flow & (p > 0)
    dstep = cost.device_adam_time_s(tail, prof, tail_step=plan.engine.tail_step,
                                    buckets=lay.n_tail_buckets) + tail_ar
    validate = 2 * prof.device_launch_s + val_ar
    order: Order = edf if plan.engine.step_order == "edf" else fifo
    # gradient stream in backward order: the reversed layers
    rp = p[::-1]
    r_hi = np.cumsum(rp)
    r_lo = r_hi - rp
    k_of = np.minimum(np.searchsorted(r_hi, lay.b_hi - 1e-9, side="left"), n_layers - 1)
    frac = np.clip((lay.b_hi - r_lo[k_of]) / np.maximum(rp[k_of], 1.0), 0.0, 1.0)

    chunks: list = []
    bwd_ends: list[float] = []
    compute_free = d2h_free = cpu_free = h2d_free = dopt_free = 0.0
    ready_next = np.zeros(nb)
    tail_ready = 0.0
    buckets = np.arange(nb)
    for it in range(n_iter):
        need_off = np.zeros(n_layers)
        if nb:
            np.maximum.at(need_off, lay.pair_layer, ready_next[lay.pair_bucket])
        need_tail = np.where(lay.has_tail, tail_ready, 0.0)
        steps = [(i, True) for i in range(n_layers)] + [(i, False) for i in reversed(range(n_layers))]
        c_start, c_end, c_kind, waits_s, waits_e = [], [], [], [], []
        f_start, f_end, f_bytes = [], [], []
        fetch_compute_end: list[float] = []
        t = compute_free
        for li, is_fwd in steps:
            ready = max(need_off[li], need_tail[li]) if is_fwd else 0.0
            if fetched[li]:
                j = len(fetch_compute_end)
                buf = fetch_compute_end[j - plan.prefetch_depth - 1] if j > plan.prefetch_depth else 0.0
                fs = max(h2d_free, need_off[li] if is_fwd else 0.0, buf)
                fe = fs + cost.link_time_s(w_bytes * p[li], prof, "h2d")
                h2d_free = fe
                f_start.append(fs)
                f_end.append(fe)
                f_bytes.append(int(w_bytes * p[li]))
                ready = max(fe, need_tail[li] if is_fwd else 0.0)
            s = max(t, ready)
            if s > t:
                waits_s.append(t)
                waits_e.append(s)
            t = s + (fwd_t[li] if is_fwd else bwd_t[li])
            c_start.append(s)
            c_end.append(t)
            c_kind.append(ev.KIND_FORWARD if is_fwd else ev.KIND_BACKWARD)
            if fetched[li]:
                fetch_compute_end.append(t)
        bwd_end = t
        bwd_ends.append(bwd_end)
        chunks.append((ev.LANE_COMPUTE, ev.KIND_FORWARD, c_start[:n_layers], c_end[:n_layers],
                       it, None, 0))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_BACKWARD, c_start[n_layers:], c_end[n_layers:],
                       it, None, 0))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_WAIT, waits_s, waits_e, it, None, 0))
        if f_start:
            chunks.append((ev.LANE_H2D, ev.KIND_WEIGHT_FETCH, f_start, f_end, it, None, f_bytes))
        v_end = bwd_end + validate
        chunks.append((ev.LANE_COMPUTE, ev.KIND_VALIDATE, [bwd_end], [v_end], it, None, 0))
        compute_free = v_end

        if nb:
            bs = np.asarray(c_start[n_layers:])  # reversed forward order == stream order
            be = np.asarray(c_end[n_layers:])
            grad_ready = bs[k_of] + frac * (be[k_of] - bs[k_of])
            ds, de = fifo(grad_ready + pre_d2h, d2h_dur, d2h_free)
            d2h_free = float(de[-1])
            cpu_ready = de if plan.speculate else np.maximum(de, v_end)
            cs, ce = order(cpu_ready, cpu_dur, cpu_free)
            h2d_ready = ce.copy()
            if clipped_iter == it and plan.speculate:
                spec = cs < v_end  # buckets stepped speculatively before validation
                if spec.any():
                    rb_s = max(float(ce[spec].max()), v_end)
                    redo = float(np.sum(adam_dur[spec]))
                    chunks.append((ev.LANE_CPU, ev.KIND_ROLLBACK, [rb_s], [rb_s + redo], it, None, 0))
                    chunks.append((ev.LANE_CPU, ev.KIND_REPLAY, [rb_s + redo],
                                   [rb_s + 2 * redo], it, None, 0))
                    h2d_ready[spec] = rb_s + 2 * redo
                    rest = ~spec
                    if rest.any():
                        cs[rest], ce[rest] = order(np.maximum(cpu_ready[rest], v_end),
                                                   cpu_dur[rest], rb_s + 2 * redo)
                        h2d_ready[rest] = ce[rest]
            cpu_free = max(float(ce.max()), float(h2d_ready.max()))
            nbytes_cpu = (shard * ADAM_BYTES_PER_PARAM).astype(np.int64)  # as the engine records
            chunks.append((ev.LANE_D2H, ev.KIND_D2H, ds, de, it, buckets,
                           (shard * g_bytes).astype(np.int64)))
            chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, cs, ce, it, buckets, nbytes_cpu))
            if flow and dp == 1:
                ready_next = h2d_ready  # the CPU wrote the host copy the next fetch reads
            else:
                # H2D in the order the steps finish (FIFO: bucket order; EDF: need order)
                sent = np.argsort(h2d_ready, kind="stable")
                hs, he = np.empty(nb), np.empty(nb)
                hs[sent], he[sent] = fifo(h2d_ready[sent], h2d_dur[sent], h2d_free)
                h2d_free = float(he.max())
                chunks.append((ev.LANE_H2D, ev.KIND_H2D, hs, he, it, buckets,
                               (shard * p_bytes).astype(np.int64)))
                ready_next = he + post_h2d + home_copy
        if tail > 0:
            s0 = max(v_end, dopt_free)
            dopt_free = s0 + dstep
            chunks.append((ev.LANE_DEVICE_OPT, ev.KIND_DEVICE_STEP, [s0], [dopt_free], it, None,
                           int(tail * ADAM_BYTES_PER_PARAM)))
            tail_ready = dopt_free
            compute_free = max(compute_free, dopt_free)  # the step runs on the device's SMs
    return bwd_ends, chunks


def accumulation_micro_step_s(shape: ModelShape, prof: HardwareProfile, plan: Resolved,
                              lay: Layout | None = None) -> float:
    """Seconds of one micro-step that only accumulates (grad_accum_steps > 1: every micro-step
    but the last): its forward and backward; accumulating on the host (ZeRO-Offload's way)
    each host bucket's gradients also cross the link and the host adds them into its fp32
    buffer (bus bytes: the DMA write, the read of the copy, the fp32 buffer read and written).
    Those pipelines overlap backward as buckets complete, so the micro-step takes the slowest
    of the three lanes in steady state (the last bucket's copy overlaps the next forward)."""
    fwd_t, bwd_t = compute.layer_times(shape, prof)
    compute_s = float(sum(fwd_t) + sum(bwd_t))
    lay = lay if lay is not None else layout(shape, plan)
    if plan.grad_accum_on != "host" or not len(lay.numel):
        return compute_s
    step = cost.host_step(prof, plan.grad_cast, plan.param_cast, plan.kernel,
                          moments=plan.optimizer_state_dtype)
    shard = np.ceil(lay.numel / shape.dp) if shape.dp > 1 else lay.numel
    d2h_s = float(np.sum(cost.link_time_s_array(shard * step.g_bytes, prof, "d2h")))
    if shape.dp > 1:
        d2h_s += float(np.sum(collectives(shape, prof, plan, lay)[0]))  # the reduce-scatter
    add_s = float(np.sum(shard)) * (2.0 * step.g_bytes + 8.0) / cost.host_bus_bps(prof)
    return max(compute_s, d2h_s, add_s)
