"""Discrete-event simulation of training iterations on the engine's lanes (DESIGN.md §3, §5).

Lanes (telemetry.events.LANES): device_compute, d2h, cpu_optimizer, h2d, device_optimizer.
Each lane is a FIFO server: a piece of work starts when its lane is free and its inputs are
ready, `end = max(lane_free, ready) + duration`. Per iteration:
  forward, layer by layer: a layer waits for its weights, i.e. the previous iteration's H2D of
    every bucket that holds its parameters (or, with weight-flow, its fetch), and for the GPU
    tail step (paper §4.2: the first layers are tail buckets, so the forward starts at once);
  backward, layer by layer in reverse: gradients stream out at a uniform rate over a layer's
    backward; bucket b is complete when the stream passes its last byte (§4.2);
  validation (global norm, inf/nan) after backward on the device (§4.3);
  offloaded buckets: [device cast] -> D2H -> CPU step -> H2D -> [device cast]; with STV the CPU
    step starts when the D2H lands, without it after validation (§4.3); an iteration that clips
    rolls the speculated buckets back and replays them;
  tail buckets: one fused device step after validation (§4.2).
The bucket lanes are vectorised scans, so a 100-layer model with thousands of buckets simulates
in milliseconds; spans are materialised only when `SimResult.timeline` is read.
Data parallel (ModelShape.dp > 1, plan/parallel.py): every quantity is one rank's; a bucket's
D2H span includes its reduce-scatter and its H2D span the all-gather (as the engine records
them), the CPU steps the rank's 1/dp shard on the rank's share of the host, the tail step waits
for the tail gradients' all-reduce and validation for a small all-reduce.
Steady state: 4 iterations are simulated; the period is the distance between the last two
backward ends. Clipping costs `rollback_rate x` the extra time of a clipped iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from superoffload.config import OffloadConfig
from superoffload.plan import cost, parallel
from superoffload.plan.memory import Memory, check_fits, memory, offloaded_params
from superoffload.plan.profiles import ADAM_BYTES_PER_PARAM, HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.techniques import Resolved, Techniques, resolve
from superoffload.telemetry import events as ev

N_ITER = 4


@dataclass(frozen=True, slots=True)
class LaneStats:
    busy_s: float
    idle_s: float

    @property
    def utilization(self) -> float:
        total = self.busy_s + self.idle_s
        return self.busy_s / total if total > 0 else 0.0


@dataclass
class SimResult:
    """What one simulation predicts. Times in seconds, memory in bytes."""

    iteration_s: float
    """Expected steady-state iteration time, clipping/rollback included."""
    steady_iteration_s: float
    """Steady-state iteration time without clipping."""
    rollback_penalty_s: float
    """Extra time of one iteration that clips and rolls back (paid rollback_rate of the time)."""
    tflops: float
    """Executed FLOP/s (recompute included, Megatron-style) / 1e12."""
    model_tflops: float
    """Useful FLOP/s (6 N tokens + attention, no recompute) / 1e12."""
    lanes: dict[str, LaneStats]
    """Busy and idle time per lane over one steady-state iteration."""
    memory: dict[str, float]
    """Bytes on the device and on the host."""
    memory_detail: Memory
    problems: list[str]
    """Why the run would not fit in memory (empty when it fits)."""
    plan: Resolved
    shape: ModelShape
    profile: str
    window: tuple[float, float]
    """The steady-state iteration's [start, end) on the timeline."""
    collective_s: float = 0.0
    """Per-rank seconds of reduce-scatter + all-gather + all-reduce in one iteration (0 at dp=1)."""
    _chunks: list[tuple[str, str, Any, Any, int, Any, Any]] = field(default_factory=list, repr=False)
    _timeline: list[ev.Span] | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def timeline(self) -> list[ev.Span]:
        """Every simulated span (all iterations), the engine's telemetry type, sorted by start."""
        if self._timeline is None:
            spans: list[ev.Span] = []
            for lane, kind, starts, ends, it, buckets, nbytes in self._chunks:
                n = len(starts)
                b = np.asarray(buckets).tolist() if buckets is not None else [-1] * n
                nb = (np.asarray(nbytes).tolist() if isinstance(nbytes, (list, np.ndarray))
                      else [int(nbytes)] * n)
                spans.extend(
                    ev.Span(lane, kind, s, e, it, bk, x)
                    for s, e, bk, x in zip(np.asarray(starts, float).tolist(),
                                           np.asarray(ends, float).tolist(), b, nb)
                )
            spans.sort(key=lambda s: (s.start_s, s.lane))
            self._timeline = spans
        return self._timeline

    @property
    def n_spans(self) -> int:
        return sum(len(c[2]) for c in self._chunks)

    def summary(self) -> dict[str, Any]:
        """JSON-safe numbers (for --json and widgets)."""
        return {
            "profile": self.profile,
            "schedule": self.plan.schedule,
            "params": self.shape.params,
            "iteration_s": self.iteration_s,
            "steady_iteration_s": self.steady_iteration_s,
            "rollback_penalty_s": self.rollback_penalty_s,
            "tflops": self.tflops,
            "model_tflops": self.model_tflops,
            "lanes": {k: {"busy_s": v.busy_s, "idle_s": v.idle_s, "utilization": v.utilization}
                      for k, v in self.lanes.items()},
            "memory": dict(self.memory),
            "fits": self.fits,
            "problems": list(self.problems),
            "plan": {k: getattr(self.plan, k) for k in self.plan.__slots__},  # type: ignore[attr-defined]
            "dp": self.shape.dp,
            "ranks_per_host": self.shape.ranks_per_host,
            "collective_s": self.collective_s,
        }


def fifo(ready: np.ndarray, dur: np.ndarray, free_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Start and end times of jobs served in order by one lane free from `free_s`:
    end_i = max(end_{i-1}, ready_i) + dur_i, in closed form
    end_i = C_i + max(free_s, max_{j<=i}(ready_j - C_{j-1})), C = cumsum(dur)."""
    if len(ready) == 0:
        return ready.copy(), ready.copy()
    c = np.cumsum(dur)
    end = c + np.maximum(np.maximum.accumulate(ready - (c - dur)), free_s)
    return end - dur, end


def simulate(shape: ModelShape, prof: HardwareProfile, schedule: str = "superoffload",
             config: OffloadConfig | None = None, techniques: Techniques | None = None) -> SimResult:
    """Predict the steady-state iteration of `shape` on `prof` (see the module docstring)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"simulate: shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(prof, HardwareProfile):
        raise TypeError(f"simulate: prof must be a HardwareProfile, got {type(prof).__name__}")
    prof = parallel.rank_profile(prof, shape.ranks_per_host)  # this rank's share of the host
    plan = resolve(shape, prof, schedule, config, techniques)
    ends, chunks = _run(shape, prof, plan, N_ITER, clipped_iter=None)
    period = float(ends[-1] - ends[-2])
    penalty = 0.0
    if plan.speculate and plan.rollback_rate > 0 and offloaded_params(shape, plan) > 0:
        # one clipped iteration (index N_ITER-2); its cost shows in the next backward end
        ends_c, _ = _run(shape, prof, plan, N_ITER, clipped_iter=N_ITER - 2)
        penalty = max(0.0, float(ends_c[-1] - ends_c[-3]) - 2 * period)
    expected = period + plan.rollback_rate * penalty
    window = (float(ends[-2]), float(ends[-1]))
    lanes = _lane_stats(chunks, window)
    mem = memory(shape, prof, plan)
    return SimResult(
        iteration_s=expected,
        steady_iteration_s=period,
        rollback_penalty_s=penalty,
        tflops=shape.executed_flops / expected / 1e12,
        model_tflops=shape.model_flops / expected / 1e12,
        lanes=lanes,
        memory=mem.as_dict(),
        memory_detail=mem,
        problems=check_fits(mem, prof),
        plan=plan,
        shape=shape,
        profile=prof.name,
        window=window,
        collective_s=_collective_s(shape, prof, plan),
        _chunks=chunks,
    )


def _collective_s(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> float:
    """Per-rank collective seconds of one iteration: the busy time the lanes carry for them."""
    if shape.dp == 1:
        return 0.0
    c = _collectives(shape, prof, plan)
    return float(np.sum(c[0]) + np.sum(c[1]) + c[2] + c[3])


def _buckets(shape: ModelShape, plan: Resolved) -> tuple[float, float, np.ndarray]:
    """(offloaded params, bucket params, params of each offloaded bucket)."""
    off = offloaded_params(shape, plan)
    bucket = off if plan.whole_model_bucket else plan.bucket_bytes / 4.0
    nb = int(math.ceil(off / bucket)) if off > 0 else 0
    b_lo = np.arange(nb) * bucket
    return off, bucket, np.minimum(b_lo + bucket, off) - b_lo


def _collectives(shape: ModelShape, prof: HardwareProfile, plan: Resolved
                 ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(reduce-scatter s per bucket, all-gather s per bucket, tail all-reduce s, validation
    all-reduce s) for one rank; zeros at dp=1. Gradients reduce in fp32 (distributed/zero.py);
    weights gather in the dtype they cross the link in."""
    off, _, numel = _buckets(shape, plan)
    n = shape.dp
    p_bytes = 4.0 if plan.param_cast == "device" else 2.0
    rs = parallel.ring_time_s(numel * 4.0, n, prof)
    ag = parallel.ring_time_s(numel * p_bytes, n, prof)
    tail = float(shape.params) - off
    tail_ar = parallel.all_reduce_time_s(4.0 * tail, n, prof)
    val_ar = parallel.all_reduce_time_s(8.0, n, prof)  # [sum of squares, non-finite count]
    return rs, ag, tail_ar, val_ar


def _lane_stats(chunks: list, window: tuple[float, float]) -> dict[str, LaneStats]:
    w0, w1 = window
    busy = dict.fromkeys(ev.LANES, 0.0)
    for lane, kind, starts, ends, *_ in chunks:
        if kind == ev.KIND_WAIT or len(starts) == 0:
            continue
        s = np.clip(np.asarray(starts, float), w0, w1)
        e = np.clip(np.asarray(ends, float), w0, w1)
        busy[lane] += float(np.sum(e - s))
    return {k: LaneStats(v, max(0.0, (w1 - w0) - v)) for k, v in busy.items()}


def _run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
         clipped_iter: int | None) -> tuple[list[float], list]:
    """Simulate `n_iter` iterations; return the backward-end times and the span chunks."""
    p = np.asarray(shape.layer_params(), dtype=float)  # forward order
    n_layers = len(p)
    fwd_t = [cost.compute_time_s(f, prof) for f in shape.layer_forward_flops()]
    bwd_t = [cost.compute_time_s(f, prof) for f in shape.layer_backward_flops()]
    total = float(p.sum())
    off = offloaded_params(shape, plan)
    tail = total - off
    flow = plan.weights == "flow" and off > 0

    # gradient stream (backward order): forward layer l occupies [lo[l], hi[l])
    cum_f = np.concatenate([[0.0], np.cumsum(p)])
    lo, hi = total - cum_f[1:], total - cum_f[:-1]
    # offloaded buckets cover [0, off) of the stream
    bucket = off if plan.whole_model_bucket else plan.bucket_bytes / 4.0
    nb = int(math.ceil(off / bucket)) if off > 0 else 0
    b_lo = np.arange(nb) * bucket
    b_hi = np.minimum(b_lo + bucket, off)
    numel = b_hi - b_lo
    dp = shape.dp
    shard = numel / dp if dp > 1 else numel  # this rank's slice of each bucket (ZeRO §5)
    # per-bucket durations (cost.py); casts folded into the lane that runs them
    fuse_g, fuse_p = cost.kernel_fuses(plan.kernel)
    adam_bytes = 28.0 - (2.0 if plan.grad_cast == "host" and fuse_g else 0.0) + (
        2.0 if plan.param_cast == "host" and fuse_p else 0.0)
    g_bytes = 4.0 if plan.grad_cast == "device" else 2.0
    p_bytes = 4.0 if plan.param_cast == "device" else 2.0
    d2h_dur = cost.link_time_s_array(shard * g_bytes, prof, "d2h")
    h2d_dur = cost.link_time_s_array(shard * p_bytes, prof, "h2d")
    adam_rate = cost.cpu_adam_rate(prof, plan.threads, plan.kernel)
    adam_dur = prof.cpu_call_s + shard / adam_rate * (adam_bytes / ADAM_BYTES_PER_PARAM)
    cpu_dur = adam_dur.copy()
    if plan.grad_cast == "host" and not fuse_g:
        cpu_dur += shard / (prof.host_cast_gelems * 1e9)
    if plan.param_cast == "host" and not fuse_p:
        cpu_dur += shard / (prof.host_cast_gelems * 1e9)
    dcast = prof.device_launch_s + numel / (prof.device_cast_gelems * 1e9)
    tail_ar = val_ar = 0.0
    if dp > 1:
        rs, ag, tail_ar, val_ar = _collectives(shape, prof, plan)
        d2h_dur = d2h_dur + rs  # reduce-scatter, then the shard's copy: one d2h span
        h2d_dur = h2d_dur + ag  # the shard's copy, then the all-gather: one h2d span
        dcast_shard = prof.device_launch_s + shard / (prof.device_cast_gelems * 1e9)
    else:
        dcast_shard = dcast
    pre_d2h = dcast_shard if plan.grad_cast == "device" else np.zeros(nb)
    post_h2d = dcast if plan.param_cast == "device" else np.zeros(nb)
    # which buckets each layer's forward needs, and whether it needs the tail step
    last_b = (np.minimum(np.ceil(np.minimum(hi, off) / bucket) - 1, nb - 1).astype(int)
              if nb else None)
    has_off = lo < off
    has_tail = hi > off
    fetched = has_off & flow & (p > 0)
    dstep = cost.device_adam_time_s(tail, prof) + tail_ar  # replicated tail: all-reduce first
    validate = 2 * prof.device_launch_s + val_ar

    chunks: list = []
    bwd_ends: list[float] = []
    compute_free = d2h_free = cpu_free = h2d_free = dopt_free = 0.0
    ready_next = np.zeros(nb)
    tail_ready = 0.0
    for it in range(n_iter):
        acc = np.maximum.accumulate(ready_next) if nb else ready_next
        need_off = np.where(has_off, acc[last_b], 0.0) if nb else np.zeros(n_layers)
        need_tail = np.where(has_tail, tail_ready, 0.0)
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
                fe = fs + cost.link_time_s(2.0 * p[li], prof, "h2d")
                h2d_free = fe
                f_start.append(fs)
                f_end.append(fe)
                f_bytes.append(int(2 * p[li]))
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
        for kind in (ev.KIND_FORWARD, ev.KIND_BACKWARD):
            idx = [i for i, k in enumerate(c_kind) if k == kind]
            chunks.append((ev.LANE_COMPUTE, kind, [c_start[i] for i in idx],
                           [c_end[i] for i in idx], it, None, 0))
        chunks.append((ev.LANE_COMPUTE, ev.KIND_WAIT, waits_s, waits_e, it, None, 0))
        if f_start:
            chunks.append((ev.LANE_H2D, ev.KIND_WEIGHT_FETCH, f_start, f_end, it, None, f_bytes))
        v_end = bwd_end + validate
        chunks.append((ev.LANE_COMPUTE, ev.KIND_VALIDATE, [bwd_end], [v_end], it, None, 0))
        compute_free = v_end

        if nb:
            # backward layer spans in stream order give each bucket's completion time
            bs = np.asarray(c_start[n_layers:])  # reversed forward order == stream order
            be = np.asarray(c_end[n_layers:])
            rp = p[::-1]
            r_hi = np.cumsum(rp)
            r_lo = r_hi - rp
            k = np.minimum(np.searchsorted(r_hi, b_hi - 1e-9, side="left"), n_layers - 1)
            frac = np.clip((b_hi - r_lo[k]) / np.maximum(rp[k], 1.0), 0.0, 1.0)
            grad_ready = bs[k] + frac * (be[k] - bs[k])
            ds, de = fifo(grad_ready + pre_d2h, d2h_dur, d2h_free)
            d2h_free = float(de[-1])
            cpu_ready = de if plan.speculate else np.maximum(de, v_end)
            cs, ce = fifo(cpu_ready, cpu_dur, cpu_free)
            h2d_ready = ce.copy()
            buckets = np.arange(nb)
            if clipped_iter == it and plan.speculate:
                m = int(np.sum(cs < v_end))  # buckets stepped speculatively before validation
                if m:
                    rb_s = max(float(ce[m - 1]), v_end)
                    redo = float(np.sum(adam_dur[:m]))
                    chunks.append((ev.LANE_CPU, ev.KIND_ROLLBACK, [rb_s], [rb_s + redo], it, None, 0))
                    chunks.append((ev.LANE_CPU, ev.KIND_REPLAY, [rb_s + redo],
                                   [rb_s + 2 * redo], it, None, 0))
                    h2d_ready[:m] = rb_s + 2 * redo
                    if m < nb:
                        cs[m:], ce[m:] = fifo(np.maximum(cpu_ready[m:], v_end), cpu_dur[m:],
                                              rb_s + 2 * redo)
                        h2d_ready[m:] = ce[m:]
            cpu_free = max(float(ce[-1]), float(h2d_ready.max()))
            nbytes_cpu = (shard * ADAM_BYTES_PER_PARAM).astype(np.int64)  # as the engine records
            chunks.append((ev.LANE_D2H, ev.KIND_D2H, ds, de, it, buckets, (shard * g_bytes).astype(np.int64)))
            chunks.append((ev.LANE_CPU, ev.KIND_CPU_STEP, cs, ce, it, buckets, nbytes_cpu))
            if flow:
                ready_next = h2d_ready  # the CPU wrote the host bf16 copy the next fetch reads
            else:
                hs, he = fifo(h2d_ready, h2d_dur, h2d_free)
                h2d_free = float(he[-1])
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
