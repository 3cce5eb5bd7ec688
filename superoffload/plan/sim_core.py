"""The lanes of one simulated iteration: the engine's bucket table on the device, link, host
and device-optimizer lanes (DESIGN.md §3, §5; the model: plan/simulate.py's docstring).

Legend: ``numel`` elements of a bucket, ``shard`` this rank's part of it (data parallel:
ceil(numel / dp), FSDP2's dim-0 shards), ``*_dur`` seconds per bucket, ``*_free`` when a lane
is next free.
Buckets are the engine's (plan.buckets via the rule book): whole parameters in gradient-ready
order, the host ones first. A bucket is complete when the gradient stream (backward, layer by
layer, uniform within a layer) passes its first-registered parameter; a layer's forward needs
the previous iteration's H2D of every host bucket holding one of its parameters. With data
parallel the walk is FSDP2's, unit by unit (plan/sim_fsdp.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from superoffload.plan import compute, cost, parallel, sim_fsdp
from superoffload.plan.hardware import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.telemetry import events as ev

D2H_STATS_LAUNCHES = 9
"""Norm / non-finite kernels ``ENGINE_H200_MEASURED``'s D2H lane launches per bucket ahead of
the copy; with one bucket in flight it also pays a host round trip (2 launches).
The engine now copies first (EngineVariant.d2h_stats_first=False): none of this."""


def fifo_order(ready: np.ndarray, dur: np.ndarray, free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Start and end times of jobs served in order by one lane free from `free_s`:
    end_i = max(end_{i-1}, ready_i) + dur_i, in closed form
    end_i = C_i + max(free_s, max_{j<=i}(ready_j - C_{j-1})), C = cumsum(dur)."""
    if len(ready) == 0:
        return ready.copy(), ready.copy()
    c = np.cumsum(dur)
    end = c + np.maximum(np.maximum.accumulate(ready - (c - dur)), free_s)
    return end - dur, end


def deadline_order(ready: np.ndarray, dur: np.ndarray,
                   free_s: float) -> tuple[np.ndarray, np.ndarray]:
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
    host = () if plan.system == "gpu" else plan.bucket_plan.host_buckets
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
    n_tail = len(plan.bucket_plan.device_buckets) if plan.system != "gpu" else len(
        plan.bucket_plan.buckets)
    return Layout(p, float(numel.sum()), numel, b_hi, key // max(nb, 1), key % max(nb, 1),
                  has_tail, has_off, n_tail)


def ddp_collectives(shape: ModelShape, prof: HardwareProfile, plan: Resolved, lay: Layout
                    ) -> tuple[float, float]:
    """(gradient all-reduce s, validation all-reduce s) of the "gpu" schedule with data
    parallel: plain PyTorch replicates the model and all-reduces every gradient (DDP, fp32)
    before the step; zeros at dp=1."""
    n = shape.dp * shape.dp_replicate
    return (parallel.all_reduce_time_s(4.0 * (float(lay.p.sum()) - lay.off), n, prof),
            parallel.all_reduce_time_s(8.0, n, prof))


Order = Callable[[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray]]


def in_arrival_order(order: Order, ready: np.ndarray, dur: np.ndarray,
                     free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """``order`` over jobs arriving at ``ready``: FIFO serves them as they arrive (the engine
    launches a bucket when its gradients are complete, which under FSDP2 need not follow the
    bucket ids); EDF picks by bucket id itself."""
    if order is deadline_order or len(ready) < 2 or bool(np.all(np.diff(ready) >= 0)):
        return order(ready, dur, free_s)
    sent = np.argsort(ready, kind="stable")
    start, end = np.empty(len(ready)), np.empty(len(ready))
    start[sent], end[sent] = order(ready[sent], dur[sent], free_s)
    return start, end


def layer_walk(lay: Layout, plan: Resolved, prof: HardwareProfile, fwd_t: list[float],
               bwd_t: list[float], it: int, t: float, h2d_free: float, ready_next: np.ndarray,
               tail_ready: float, fetched: np.ndarray, w_bytes: float
               ) -> tuple[float, np.ndarray, float, list]:
    """One process's forward and backward from ``t`` (module docstring): (backward end, the
    time each host bucket's gradients are complete, the H2D lane's next free time, span
    chunks). Weight-flow fetches share the H2D lane with the publishes."""
    p, nb, n_layers = lay.p, len(lay.numel), len(lay.p)
    need_off = np.zeros(n_layers)
    if nb:
        np.maximum.at(need_off, lay.pair_layer, ready_next[lay.pair_bucket])
    need_tail = np.where(lay.has_tail, tail_ready, 0.0)
    steps = [(i, True) for i in range(n_layers)] + [(i, False) for i in reversed(range(n_layers))]
    c_start, c_end, waits_s, waits_e = [], [], [], []
    f_start, f_end, f_bytes = [], [], []
    fetch_compute_end: list[float] = []
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
        if fetched[li]:
            fetch_compute_end.append(t)
    chunks: list = [
        (ev.LANE_COMPUTE, ev.KIND_FORWARD, c_start[:n_layers], c_end[:n_layers], it, None, 0),
        (ev.LANE_COMPUTE, ev.KIND_BACKWARD, c_start[n_layers:], c_end[n_layers:], it, None, 0),
        (ev.LANE_COMPUTE, ev.KIND_WAIT, waits_s, waits_e, it, None, 0)]
    if f_start:
        chunks.append((ev.LANE_H2D, ev.KIND_WEIGHT_FETCH, f_start, f_end, it, None, f_bytes))
    grad_ready = np.zeros(nb)
    if nb:  # gradient stream in backward order: the reversed layers, uniform within each
        rp = p[::-1]
        r_hi = np.cumsum(rp)
        r_lo = r_hi - rp
        k_of = np.minimum(np.searchsorted(r_hi, lay.b_hi - 1e-9, side="left"), n_layers - 1)
        frac = np.clip((lay.b_hi - r_lo[k_of]) / np.maximum(rp[k_of], 1.0), 0.0, 1.0)
        bs = np.asarray(c_start[n_layers:])  # reversed forward order == stream order
        be = np.asarray(c_end[n_layers:])
        grad_ready = bs[k_of] + frac * (be[k_of] - bs[k_of])
    return t, grad_ready, h2d_free, chunks


def run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
        clipped_iter: int | None, lay: Layout | None = None) -> tuple[list[float], list]:
    """Simulate `n_iter` iterations; return the backward-end times and the span chunks.
    `lay`: ``layout(shape, plan)`` when the caller has it already. With data parallel the
    compute walk is FSDP2's (plan/sim_fsdp.py) and every bucket lane works on this rank's
    shard of each bucket (numel / dp)."""
    lay = lay if lay is not None else layout(shape, plan)
    p, off, numel, nb = lay.p, lay.off, lay.numel, len(lay.numel)
    fwd_t, bwd_t = compute.layer_times(shape, prof)
    tail = float(p.sum()) - off
    flow = plan.weights == "flow" and off > 0
    low = plan.model_dtype != "float32"
    w_bytes = 2.0 if low else 4.0
    dp = shape.dp
    fl = sim_fsdp.fsdp_layout(shape, prof, plan, nb) if plan.units is not None else None
    shard = np.ceil(numel / dp) if dp > 1 else numel  # this rank's slice of each bucket
    step = cost.host_step(prof, plan.grad_cast, plan.param_cast, plan.kernel, flow=flow,
                          moments=plan.optimizer_state_dtype)
    g_bytes, p_bytes = step.g_bytes, step.p_bytes
    d2h_dur = cost.link_time_s_array(shard * g_bytes, prof, "d2h")
    h2d_dur = cost.link_time_s_array(shard * p_bytes, prof, "h2d")
    if fl is not None and fl.bucket_on_host.any():  # weight-flow shards live on the host
        d2h_dur = np.where(fl.bucket_on_host, sim_fsdp.host_copy_s(shard * g_bytes, prof),
                           d2h_dur)
        h2d_dur = np.where(fl.bucket_on_host, sim_fsdp.host_copy_s(shard * p_bytes, prof),
                           h2d_dur)
    if plan.engine.d2h_stats_first and nb:
        d2h_dur = d2h_dur + (D2H_STATS_LAUNCHES + 2) * prof.device_launch_s
    adam_dur = cost.host_step_s(shard, prof, plan.threads, plan.kernel, step)
    cpu_dur = prof.cpu_call_s + adam_dur
    dcast = prof.device_launch_s + shard / (prof.device_cast_gelems * 1e9)
    pre_d2h = dcast if plan.grad_cast == "device" and low else np.zeros(nb)
    post_h2d = dcast if plan.param_cast == "device" and low else np.zeros(nb)
    tail_ar = val_ar = 0.0
    if fl is not None:
        val_ar = fl.validation_s
        tail = tail / dp  # FSDP2: the tail is stepped over this rank's shards
    elif dp > 1:
        tail_ar, val_ar = ddp_collectives(shape, prof, plan, lay)
    fetched = lay.has_off & flow & (p > 0) & (fl is None)
    dstep = cost.device_adam_time_s(tail, prof, tail_step=plan.engine.tail_step,
                                    buckets=lay.n_tail_buckets) + tail_ar
    validate = 2 * prof.device_launch_s + val_ar
    order: Order = deadline_order if plan.engine.step_order == "deadline" else fifo_order

    chunks: list = []
    bwd_ends: list[float] = []
    compute_free = d2h_free = cpu_free = h2d_free = dopt_free = comm_free = 0.0
    ready_next = np.zeros(nb)
    tail_ready = 0.0
    buckets = np.arange(nb)
    for it in range(n_iter):
        if fl is None:
            bwd_end, grad_ready, h2d_free, walked = layer_walk(
                lay, plan, prof, fwd_t, bwd_t, it, compute_free, h2d_free, ready_next,
                tail_ready, fetched, w_bytes)
        else:
            bwd_end, grad_ready, comm_free, walked = sim_fsdp.walk(
                fl, fwd_t, bwd_t, it, compute_free, comm_free, ready_next, tail_ready)
        chunks.extend(walked)
        bwd_ends.append(bwd_end)
        v_end = bwd_end + validate
        chunks.append((ev.LANE_COMPUTE, ev.KIND_VALIDATE, [bwd_end], [v_end], it, None, 0))
        compute_free = v_end

        if nb:
            # the D2H lane copies buckets as their gradients complete
            ds, de = in_arrival_order(fifo_order, grad_ready + pre_d2h, d2h_dur, d2h_free)
            d2h_free = float(de.max())
            cpu_ready = de if plan.speculate else np.maximum(de, v_end)
            cs, ce = in_arrival_order(order, cpu_ready, cpu_dur, cpu_free)
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
                        cs[rest], ce[rest] = in_arrival_order(
                            order, np.maximum(cpu_ready[rest], v_end), cpu_dur[rest],
                            rb_s + 2 * redo)
                        h2d_ready[rest] = ce[rest]
            cpu_free = max(float(ce.max()), float(h2d_ready.max()))
            nbytes_cpu = (shard * ADAM_BYTES_PER_PARAM).astype(np.int64)  # as the engine records
            chunks.append((ev.LANE_D2H, ev.KIND_D2H, ds, de, it, buckets,
                           (shard * g_bytes).astype(np.int64)))
            chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, cs, ce, it, buckets, nbytes_cpu))
            if flow and fl is None:
                ready_next = h2d_ready  # the CPU wrote the host copy the next fetch reads
            else:
                # H2D in the order the steps finish (FIFO: bucket order; EDF: need order)
                sent = np.argsort(h2d_ready, kind="stable")
                hs, he = np.empty(nb), np.empty(nb)
                hs[sent], he[sent] = fifo_order(h2d_ready[sent], h2d_dur[sent], h2d_free)
                h2d_free = float(he.max())
                chunks.append((ev.LANE_H2D, ev.KIND_H2D, hs, he, it, buckets,
                               (shard * p_bytes).astype(np.int64)))
                ready_next = he + post_h2d
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
    of the three lanes in steady state (the last bucket's copy overlaps the next forward).
    With data parallel FSDP2 gathers every unit each micro-step, and reduce-scatters only
    when accumulating on the host (on the device it accumulates unsharded gradients:
    ``set_requires_gradient_sync(False)``): added as the backend lets compute hide it
    (plan/sim_fsdp.py)."""
    fwd_t, bwd_t = compute.layer_times(shape, prof)
    compute_s = float(sum(fwd_t) + sum(bwd_t))
    lay = lay if lay is not None else layout(shape, plan)
    host = plan.grad_accum_on == "host" and len(lay.numel) > 0
    if plan.units is not None:
        fl = sim_fsdp.fsdp_layout(shape, prof, plan, len(lay.numel))
        compute_s += sim_fsdp.micro_step_collective_s(fl, compute_s, reduces=host)
    if not host:
        return compute_s
    step = cost.host_step(prof, plan.grad_cast, plan.param_cast, plan.kernel,
                          moments=plan.optimizer_state_dtype)
    shard = np.ceil(lay.numel / shape.dp) if shape.dp > 1 else lay.numel
    d2h_s = float(np.sum(cost.link_time_s_array(shard * step.g_bytes, prof, "d2h")))
    add_s = float(np.sum(shard)) * (2.0 * step.g_bytes + 8.0) / cost.host_bus_bps(prof)
    return max(compute_s, d2h_s, add_s)
