"""The lanes of one simulated iteration: the engine's bucket table on the device, link, host
and device-optimizer lanes (DESIGN.md §3, §5; the model: plan/simulator.py's docstring).

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
from superoffload.plan.memory_host import file_home_numel, host_side, planned_homes
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
    # c - dur is C_{j-1}: the work queued ahead of job j, so ready_j - C_{j-1} is the lane's
    # earliest start that lets job j begin on time.
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
    # Non-decreasing arrivals (ties included) admit the stack shortcut below; the heap is the
    # general case.
    if n < 2 or bool(np.all(np.diff(ready) >= 0)):
        # arrivals in index order (the D2H lane is FIFO by bucket id): the highest ready
        # index is the latest arrival, so the heap is a stack
        stack: list[int] = []
        for _ in range(n):
            if not stack and r[k] > t:
                # Idle lane: jump to the next arrival (non-preemptive, never waits for a later
                # higher-priority job).
                t = r[k]
            while k < n and r[k] <= t:
                stack.append(k)
                k += 1
            j = stack.pop()
            start[j] = t
            t += d[j]
            end[j] = t
        return np.asarray(start), np.asarray(end)
    # Ties in ready time admit the lower index first, as the stack path does.
    arrival = sorted(range(n), key=lambda i: (r[i], i))
    # Negated ids: heapq is a min-heap and EDF wants the highest id.
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
    # fp32 gradients of the device-resident parameters (all of them in the "gpu" schedule);
    # the validation's reduction carries only its scalars (8 B): latency, not bandwidth.
    return (parallel.all_reduce_time_s(4.0 * (float(lay.p.sum()) - lay.off), n, prof),
            parallel.all_reduce_time_s(8.0, n, prof))


Order = Callable[[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray]]


def in_arrival_order(order: Order, ready: np.ndarray, dur: np.ndarray,
                     free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """``order`` over jobs arriving at ``ready``: FIFO serves them as they arrive (the engine
    launches a bucket when its gradients are complete, which under FSDP2 need not follow the
    bucket ids); EDF picks by bucket id itself."""
    # EDF sorts by arrival itself; FIFO only needs a permutation when arrivals are out of
    # bucket order.
    if order is deadline_order or len(ready) < 2 or bool(np.all(np.diff(ready) >= 0)):
        return order(ready, dur, free_s)
    # stable: equal arrival times keep bucket order, as the engine's queue does
    sent = np.argsort(ready, kind="stable")
    start, end = np.empty(len(ready)), np.empty(len(ready))
    start[sent], end[sent] = order(ready[sent], dur[sent], free_s)
    return start, end


def run_timeline(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
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
    # Weight flow only matters when some parameters live on the host (off > 0).
    flow = plan.weights == "flow" and off > 0
    low = plan.model_dtype != "float32"
    w_bytes = 2.0 if low else 4.0
    dp = shape.dp
    fl = None
    if plan.units is not None:
        # FSDP2 units: the compute walk and the collectives come from plan/sim_fsdp.py.
        fl = sim_fsdp.fsdp_layout(shape, prof, plan, nb)
    if dp > 1:
        # This rank's slice of each bucket, rounded up: the last rank's shard is padded.
        shard = np.ceil(numel / dp)
    else:
        shard = numel
    step = cost.host_step(prof, plan.grad_cast, plan.param_cast, plan.kernel, flow=flow,
                          moments=plan.optimizer_state_dtype)
    g_bytes, p_bytes = step.g_bytes, step.p_bytes
    d2h_dur = cost.link_time_s_array(shard * g_bytes, prof, "d2h")
    h2d_dur = cost.link_time_s_array(shard * p_bytes, prof, "h2d")
    if fl is not None and fl.bucket_on_host.any():
        # Weight-flow shards live on the host: their "link" copies are host memory copies.
        d2h_dur = np.where(fl.bucket_on_host, sim_fsdp.host_copy_s(shard * g_bytes, prof),
                           d2h_dur)
        h2d_dur = np.where(fl.bucket_on_host, sim_fsdp.host_copy_s(shard * p_bytes, prof),
                           h2d_dur)
    if plan.engine.d2h_stats_first and nb:
        # The stats kernels and the host round trip ahead of each copy (D2H_STATS_LAUNCHES).
        d2h_dur = d2h_dur + (D2H_STATS_LAUNCHES + 2) * prof.device_launch_s
    adam_dur = cost.host_step_s(shard, prof, plan.threads, plan.kernel, step)
    jobs, tier_reads = _tier(shape, prof, plan, lay)
    if jobs is not None and jobs.tier.any():
        # The tier's DMA crosses the host bus too, slowing the bus-bound Adam of its buckets.
        for b in np.flatnonzero(jobs.tier):
            io_step = replace(step, bus_bytes=step.bus_bytes + float(jobs.io_bus_bytes[b]))
            adam_dur[b] = cost.host_step_s(shard[b], prof, plan.threads, plan.kernel, io_step)
    cpu_dur = prof.cpu_call_s + adam_dur
    dcast = prof.device_launch_s + shard / (prof.device_cast_gelems * 1e9)
    # A device-side cast (§4.4) runs on the compute stream before the D2H / after the H2D;
    # fp32 models have nothing to cast.
    if plan.grad_cast == "device" and low:
        pre_d2h = dcast
    else:
        pre_d2h = np.zeros(nb)
    if plan.param_cast == "device" and low:
        post_h2d = dcast
    else:
        post_h2d = np.zeros(nb)
    tail_ar = val_ar = 0.0
    if fl is not None:
        val_ar = fl.validation_s
        # FSDP2: the tail is stepped over this rank's shards
        tail = tail / dp
    elif dp > 1:
        tail_ar, val_ar = ddp_collectives(shape, prof, plan, lay)
    # Weight flow fetches a layer's host weights before its forward (FSDP2 gathers instead).
    fetched = lay.has_off & flow & (p > 0) & (fl is None)
    dstep = cost.device_adam_time_s(tail, prof, tail_step=plan.engine.tail_step,
                                    buckets=lay.n_tail_buckets) + tail_ar
    # The validation (§4.3): the norm / non-finite reduction and its check, two launches.
    validate = 2 * prof.device_launch_s + val_ar
    order: Order = fifo_order
    if plan.engine.step_order == "deadline":
        # Step the bucket the next forward needs first (deadline_order's docstring).
        order = deadline_order
    lanes = None
    if jobs is not None:
        # a storage lane only when some bucket's state lives on the tier
        lanes = sim_storage.LaneState()
    if lanes is not None and tier_reads is not None:
        # One storage lane for reads and writes: the drive serves both.
        tier_reads = replace(tier_reads, lane=lanes.lane)

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
                # STV (§4.3) steps without waiting for the validation; otherwise the CPU
                # steps are gated on it.
                gate = 0.0 if plan.speculate else v_end
                ph = sim_storage.bucket_phase(
                    jobs, lanes, grad_at=grad_ready + pre_d2h, d2h_dur=d2h_dur,
                    cpu_dur=cpu_dur, h2d_dur=h2d_dur, deadline=order is deadline_order,
                    gate=gate, read_from=start, d2h_free=d2h_free, cpu_free=cpu_free)
                ds, de, cs, ce, copy_end = ph.ds, ph.de, ph.cs, ph.ce, ph.copy_end
                cpu_ready = cs.copy()
                chunks.extend(sim_storage.chunks(ph, it))
            else:
                # the D2H lane copies buckets as their gradients complete
                ds, de = in_arrival_order(fifo_order, grad_ready + pre_d2h, d2h_dur, d2h_free)
                if plan.speculate:
                    # STV (§4.3): a bucket is stepped as soon as its gradients are on the host.
                    cpu_ready = de
                else:
                    # Without speculation every step waits for the global validation.
                    cpu_ready = np.maximum(de, v_end)
                cs, ce = in_arrival_order(order, cpu_ready, cpu_dur, cpu_free)
            d2h_free = float(de.max())
            h2d_ready = ce.copy()
            if clipped_iter == it and plan.speculate:
                # buckets stepped speculatively before validation: the clipped iteration
                # rolls them back and replays them (§4.3)
                spec = cs < v_end
                if spec.any():
                    # the rollback starts once both the verdict and the last step are in
                    rb_s = max(float(ce[spec].max()), v_end)
                    on_tier = np.zeros(nb, dtype=bool)
                    if jobs is not None:
                        on_tier = jobs.tier
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
                        # buckets not yet stepped wait for the verdict and the replay
                        cs[rest], ce[rest] = in_arrival_order(
                            order, np.maximum(cpu_ready[rest], v_end), cpu_dur[rest], done)
                        h2d_ready[rest] = ce[rest]
            # a replay (h2d_ready) can end after the last regular step
            cpu_free = max(float(ce.max()), float(h2d_ready.max()))
            # as the engine records its CPU-step spans
            nbytes_cpu = (shard * ADAM_BYTES_PER_PARAM).astype(np.int64)
            chunks.append((ev.LANE_D2H, ev.KIND_D2H, ds, de, it, buckets,
                           (shard * g_bytes).astype(np.int64)))
            chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, cs, ce, it, buckets, nbytes_cpu))
            if flow and fl is None:
                # the CPU wrote the host copy the next fetch reads (to its home on the tier)
                if copy_end is None:
                    ready_next = h2d_ready
                else:
                    # a tier bucket's copy is readable only once it reached the file
                    ready_next = np.maximum(h2d_ready, copy_end)
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
            # the device tail steps after the validation, on one device-optimizer lane
            s0 = max(v_end, dopt_free)
            dopt_free = s0 + dstep
            chunks.append((ev.LANE_DEVICE_OPT, ev.KIND_DEVICE_STEP, [s0], [dopt_free], it, None,
                           int(tail * ADAM_BYTES_PER_PARAM)))
            tail_ready = dopt_free
            # the step runs on the device's SMs: the next forward waits for it
            compute_free = max(compute_free, dopt_free)
    return bwd_ends, chunks


def _tier(shape: ModelShape, prof: HardwareProfile, plan: Resolved, lay: Layout
          ) -> tuple[sim_storage.TierJobs | None, TierReads | None]:
    """The storage tier's jobs per host bucket and the reads of weight-flow's homes in its file
    per layer (plan/sim_storage.py); (None, None) when nothing is on the tier."""
    if not plan.storage or plan.system != "superoffload":
        return None, None
    # only FSDP2 shards host state across ranks; DDP replicates it
    dp = shape.dp if plan.units is not None else 1
    side = host_side(shape, plan, dp)
    jobs = sim_storage.tier_jobs(side, plan, prof, len(lay.numel))
    homes = planned_homes(plan)
    if jobs is None:
        return None, None
    per_layer = file_home_numel(shape, plan, side.tier, dp)
    reads = None
    if homes is not None and per_layer.any():
        # weight flow reads each layer's homes from the file before its fetch
        reads = TierReads(per_layer * homes.stream, sim_storage.StorageLane(),
                          sim_storage.rates_bps(prof, plan)[0])
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
    if shape.dp > 1:
        shard = np.ceil(lay.numel / shape.dp)
    else:
        shard = lay.numel
    d2h_s = float(np.sum(cost.link_time_s_array(shard * step.g_bytes, prof, "d2h")))
    # bus bytes per element: the DMA write and the read of the copy (2 x g_bytes), the fp32
    # accumulation buffer read and written (8)
    add_s = float(np.sum(shard)) * (2.0 * step.g_bytes + 8.0) / cost.host_bus_bps(prof)
    return max(compute_s, d2h_s, add_s)
