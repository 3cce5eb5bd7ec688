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
from dataclasses import replace

import numpy as np

from superoffload.plan import compute, cost, parallel, sim_fsdp, sim_storage
from superoffload.plan.hardware import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.memory_host import file_home_numel, homes_of, host_side
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.sim_walk import Layout, TierReads, layer_walk, layout
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


def run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
        clipped_iter: int | None, lay: Layout | None = None) -> tuple[list[float], list]:
    """Simulate `n_iter` iterations; return the backward-end times and the span chunks.
    `lay`: ``layout(shape, plan)`` when the caller has it already. With data parallel the
    compute walk is FSDP2's (plan/sim_fsdp.py) and every bucket lane works on this rank's
    shard of each bucket (numel / dp). Buckets or weights on the storage tier add its lane
    (plan/sim_storage.py)."""
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
    jobs, tier_reads = _tier(shape, prof, plan, lay)
    if jobs is not None and jobs.tier.any():  # the tier's DMA crosses the host bus too
        for b in np.flatnonzero(jobs.tier):
            io_step = replace(step, bus_bytes=step.bus_bytes + float(jobs.io_bus_bytes[b]))
            adam_dur[b] = cost.host_step_s(shard[b], prof, plan.threads, plan.kernel, io_step)
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
    lanes = sim_storage.LaneState() if jobs is not None else None
    if lanes is not None and tier_reads is not None:
        tier_reads = replace(tier_reads, lane=lanes.lane)  # one lane for reads and writes

    chunks: list = []
    bwd_ends: list[float] = []
    compute_free = d2h_free = cpu_free = h2d_free = dopt_free = comm_free = 0.0
    ready_next = np.zeros(nb)
    tail_ready = 0.0
    buckets = np.arange(nb)
    for it in range(n_iter):
        start = compute_free
        if fl is None:
            bwd_end, grad_ready, h2d_free, walked = layer_walk(
                lay, plan, prof, fwd_t, bwd_t, it, compute_free, h2d_free, ready_next,
                tail_ready, fetched, w_bytes, tier_reads)
        else:
            bwd_end, grad_ready, comm_free, walked = sim_fsdp.walk(
                fl, fwd_t, bwd_t, it, compute_free, comm_free, ready_next, tail_ready)
        chunks.extend(walked)
        bwd_ends.append(bwd_end)
        v_end = bwd_end + validate
        chunks.append((ev.LANE_COMPUTE, ev.KIND_VALIDATE, [bwd_end], [v_end], it, None, 0))
        compute_free = v_end

        if nb:
            copy_end = None
            if jobs is not None and lanes is not None:
                ph = sim_storage.bucket_phase(
                    jobs, lanes, grad_at=grad_ready + pre_d2h, d2h_dur=d2h_dur,
                    cpu_dur=cpu_dur, h2d_dur=h2d_dur, deadline=order is deadline_order,
                    gate=0.0 if plan.speculate else v_end, read_from=start, d2h_free=d2h_free,
                    cpu_free=cpu_free)
                ds, de, cs, ce, copy_end = ph.ds, ph.de, ph.cs, ph.ce, ph.copy_end
                cpu_ready = cs.copy()
                chunks.extend(sim_storage.chunks(ph, it))
            else:
                # the D2H lane copies buckets as their gradients complete
                ds, de = in_arrival_order(fifo_order, grad_ready + pre_d2h, d2h_dur, d2h_free)
                cpu_ready = de if plan.speculate else np.maximum(de, v_end)
                cs, ce = in_arrival_order(order, cpu_ready, cpu_dur, cpu_free)
            d2h_free = float(de.max())
            h2d_ready = ce.copy()
            if clipped_iter == it and plan.speculate:
                spec = cs < v_end  # buckets stepped speculatively before validation
                if spec.any():
                    rb_s = max(float(ce[spec].max()), v_end)
                    on_tier = jobs.tier if jobs is not None else np.zeros(nb, dtype=bool)
                    # a tier bucket's rollback is the version switch not made: nothing undone
                    undo = float(np.sum(adam_dur[spec & ~on_tier]))
                    redo = float(np.sum(adam_dur[spec]))
                    done = rb_s + undo + redo
                    if lanes is not None and jobs is not None and (spec & on_tier).any():
                        # the replay reads the state in force and the gradient back
                        _, read_e = lanes.lane.place(rb_s, float(np.sum(
                            jobs.replay_read_s[spec & on_tier])))
                        done = max(done, read_e)
                        lanes.lane.place(done, float(np.sum(jobs.write_s[spec & on_tier])))
                    chunks.append((ev.LANE_CPU, ev.KIND_ROLLBACK, [rb_s], [rb_s + undo], it,
                                   None, 0))
                    chunks.append((ev.LANE_CPU, ev.KIND_REPLAY, [done - redo], [done], it,
                                   None, 0))
                    h2d_ready[spec] = done
                    rest = ~spec
                    if rest.any():
                        cs[rest], ce[rest] = in_arrival_order(
                            order, np.maximum(cpu_ready[rest], v_end), cpu_dur[rest], done)
                        h2d_ready[rest] = ce[rest]
            cpu_free = max(float(ce.max()), float(h2d_ready.max()))
            nbytes_cpu = (shard * ADAM_BYTES_PER_PARAM).astype(np.int64)  # as the engine records
            chunks.append((ev.LANE_D2H, ev.KIND_D2H, ds, de, it, buckets,
                           (shard * g_bytes).astype(np.int64)))
            chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, cs, ce, it, buckets, nbytes_cpu))
            if flow and fl is None:
                # the CPU wrote the host copy the next fetch reads (to its home on the tier)
                ready_next = h2d_ready if copy_end is None else np.maximum(h2d_ready, copy_end)
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


def _tier(shape: ModelShape, prof: HardwareProfile, plan: Resolved, lay: Layout
          ) -> tuple[sim_storage.TierJobs | None, TierReads | None]:
    """The storage tier's jobs per host bucket and the reads of weight-flow's homes in its file
    per layer (plan/sim_storage.py); (None, None) when nothing is on the tier."""
    if not plan.storage or plan.system != "superoffload":
        return None, None
    dp = shape.dp if plan.units is not None else 1
    side = host_side(shape, plan, dp)
    jobs = sim_storage.tier_jobs(side, plan, prof, len(lay.numel))
    homes = homes_of(plan)
    if jobs is None:
        return None, None
    per_layer = file_home_numel(shape, plan, side.tier, dp)
    reads = (TierReads(per_layer * homes.stream, sim_storage.StorageLane(),
                       sim_storage.rates_bps(prof, plan)[0])
             if homes is not None and per_layer.any() else None)
    return jobs, reads


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
