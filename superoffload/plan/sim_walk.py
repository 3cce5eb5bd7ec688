"""The layers of a simulated iteration and the walk through them: forward layer by layer,
then backward in reverse (DESIGN.md §3; the model: plan/simulator.py's docstring).

``layout`` maps the engine's bucket table onto the layers; ``layer_walk`` times one process's
forward and backward on the compute lane, weight-flow's fetches on the H2D lane (and, for
blocks whose home is on the storage tier, their reads on the storage lane: plan/sim_storage.py)
and when each host bucket's gradients are complete. With data parallel the walk is FSDP2's
(plan/sim_fsdp.py). A bucket is complete when the gradient stream (backward, layer by layer,
uniform within a layer) passes its first-registered parameter; a layer's forward needs the
previous iteration's H2D of every host bucket holding one of its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from superoffload.plan import cost
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.sim_storage import StorageLane
from superoffload.telemetry import events as ev


@dataclass(frozen=True, slots=True)
class TierReads:
    """Weight-flow's homes in the storage tier's file, and the lane that reads them."""

    read_bytes: np.ndarray
    """Per layer: bytes a fetch of it reads from the file first."""
    lane: StorageLane
    read_bps: float


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
    # backward produces gradients in reverse registration order: a parameter's gradient is
    # complete once the stream has passed everything registered after it
    stream_end = float(p.sum()) - np.concatenate([[0], np.cumsum(pn)[:-1]]).astype(float)
    p_hb = np.full(len(pn), -1, dtype=np.int64)
    # the "gpu" schedule (plain PyTorch) offloads nothing
    host = () if plan.system == "gpu" else plan.bucket_plan.host_buckets
    if host:
        # host bucket ids are 0..len(host)-1 (plan_buckets offloads a leading run)
        sizes = [len(b.param_indices) for b in host]
        members = np.fromiter(chain.from_iterable(b.param_indices for b in host),
                              dtype=np.int64, count=sum(sizes))
        p_hb[members] = np.repeat(np.arange(len(host), dtype=np.int64), sizes)
    on_host = p_hb >= 0
    if plan.whole_model_bucket and on_host.any():
        # the ablation without buckets: one transfer and one step
        p_hb[on_host] = 0
    nb = int(p_hb.max()) + 1 if on_host.any() else 0
    numel = np.bincount(p_hb[on_host], weights=pn[on_host], minlength=nb).astype(float)
    b_hi = np.zeros(nb)
    np.maximum.at(b_hi, p_hb[on_host], stream_end[on_host])
    # (layer, bucket) pairs encoded in one integer, so np.unique dedups them
    key = np.unique(layer[on_host] * max(nb, 1) + p_hb[on_host])
    # zero-sized parameters neither need a fetch nor wait for a step
    live = pn > 0
    has_off = np.bincount(layer[on_host & live], minlength=n_layers) > 0
    has_tail = np.bincount(layer[~on_host & live], minlength=n_layers) > 0
    if plan.system != "gpu":
        n_tail = len(plan.bucket_plan.device_buckets)
    else:
        # without offload every bucket is stepped on the device
        n_tail = len(plan.bucket_plan.buckets)
    return Layout(p, float(numel.sum()), numel, b_hi, key // max(nb, 1), key % max(nb, 1),
                  has_tail, has_off, n_tail)



def layer_walk(lay: Layout, plan: Resolved, prof: HardwareProfile, fwd_t: list[float],
               bwd_t: list[float], it: int, t: float, h2d_free: float, ready_next: np.ndarray,
               tail_ready: float, fetched: np.ndarray, w_bytes: float,
               tier: TierReads | None = None) -> tuple[float, np.ndarray, float, list]:
    """One process's forward and backward from ``t`` (module docstring): (backward end, the
    time each host bucket's gradients are complete, the H2D lane's next free time, span
    chunks). Weight-flow fetches share the H2D lane with the publishes; a block with homes in
    the storage tier's file (``tier``) reads them into a staging buffer first
    (plan/storage.py: ``prefetch_depth + 1`` buffers, one freed when its fetch has ended)."""
    p, nb, n_layers = lay.p, len(lay.numel), len(lay.p)
    need_off = np.zeros(n_layers)
    if nb:
        np.maximum.at(need_off, lay.pair_layer, ready_next[lay.pair_bucket])
    # a layer with device-stepped parameters waits for the previous iteration's tail step
    need_tail = np.where(lay.has_tail, tail_ready, 0.0)
    forward = [(i, True) for i in range(n_layers)]
    steps = forward + [(i, False) for i in reversed(range(n_layers))]
    c_start, c_end, waits_s, waits_e = [], [], [], []
    f_start: list[float] = []
    f_end: list[float] = []
    f_bytes: list[int] = []
    fetch_compute_end: list[float] = []
    r_start, r_end, r_bytes = [], [], []
    for li, is_fwd in steps:
        if is_fwd:
            # the last iteration's updates must be in: the host buckets' H2D, the tail's step
            off_at, tail_at = need_off[li], need_tail[li]
        else:
            # backward reuses what forward waited for
            off_at, tail_at = 0.0, 0.0
        ready = max(off_at, tail_at)
        if fetched[li]:
            j = len(fetch_compute_end)
            # prefetch_depth + 1 buffers: fetch j reuses fetch (j - depth - 1)'s, free once
            # that layer's compute is done (a staging buffer: once that fetch has ended)
            buf = host_buf = 0.0
            if j > plan.prefetch_depth:
                buf = fetch_compute_end[j - plan.prefetch_depth - 1]
                host_buf = f_end[j - plan.prefetch_depth - 1]
            fs = max(h2d_free, off_at, buf)
            if tier is not None and tier.read_bytes[li]:
                # homes in the file: read them into a staging buffer first
                rs, re = tier.lane.place(max(off_at, host_buf),
                                         tier.read_bytes[li] / tier.read_bps)
                r_start.append(rs)
                r_end.append(re)
                r_bytes.append(int(tier.read_bytes[li]))
                fs = max(fs, re)
            fe = fs + cost.link_time_s(w_bytes * p[li], prof, "h2d")
            # fetches and the buckets' publishes share the one H2D lane
            h2d_free = fe
            f_start.append(fs)
            f_end.append(fe)
            f_bytes.append(int(w_bytes * p[li]))
            ready = max(fe, tail_at)
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
    if r_start:
        chunks.append((ev.LANE_STORAGE, ev.KIND_TIER_READ, r_start, r_end, it, None, r_bytes))
    grad_ready = np.zeros(nb)
    if nb:
        # gradient stream in backward order: the reversed layers, uniform within each
        rp = p[::-1]
        r_hi = np.cumsum(rp)
        r_lo = r_hi - rp
        # the layer where each bucket's last element streams; the 1e-9 keeps a bucket ending
        # exactly on a layer boundary in that layer, not the next; clipped for float excess
        k_of = np.minimum(np.searchsorted(r_hi, lay.b_hi - 1e-9, side="left"), n_layers - 1)
        # the max(.., 1) guards an empty layer against dividing by zero
        frac = np.clip((lay.b_hi - r_lo[k_of]) / np.maximum(rp[k_of], 1.0), 0.0, 1.0)
        # reversed forward order == stream order
        bs = np.asarray(c_start[n_layers:])
        be = np.asarray(c_end[n_layers:])
        grad_ready = bs[k_of] + frac * (be[k_of] - bs[k_of])
    return t, grad_ready, h2d_free, chunks
