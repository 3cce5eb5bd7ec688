"""The device-compute walk of one data-parallel iteration over FSDP2 (``FsdpOffloadEngine``;
docs/planner.md, "Data parallel"; the units: plan/fsdp_units.py).

Per rank, with N = ``ModelShape.dp`` shard ranks and R = ``dp_replicate`` replicas (HSDP):

* forward: before a unit's first layer FSDP2 all-gathers its weights (the root's opens the
  forward; weight-stationary units stay gathered through backward, weight-flow's block units
  are freed after forward and gathered again before their backward). The engine's pre-hook
  makes each all-gather wait for the publish (H2D of the stepped shard) of every host bucket
  holding one of the unit's parameters (distributed/fsdp/hooks.py);
* backward: after a unit's last layer (its lowest; the root's is the embedding, so the root
  reduces last) FSDP2 reduce-scatters its gradients (under HSDP then all-reduces the reduced
  shard across the R replicas). A bucket's gradients are complete -- its post-accumulate
  hooks have fired and the engine launches its D2H -- when the last unit holding one of its
  parameters has reduced (``UnitPlan.buckets_of``);
* a weight-flow unit's shards live on the host: on a GPU, FSDP2 copies the shard in before
  each all-gather and the reduced gradient shard out after the reduce-scatter (a blocking
  copy: the engine's post-accumulate hooks read it);
* the collective backend decides the overlap (``parallel.collective_backend``): gloo (a CPU
  device) runs each collective synchronously in the training thread -- compute waits for it
  (drawn as a wait on the compute lane); NCCL runs them on FSDP2's communication streams, one
  at a time, overlapping compute: an all-gather is issued one unit ahead (``prefetch_depth``
  units under weight-flow, FSDP2's forward prefetch), a reduce-scatter when its unit's
  backward ends, and backward ends when the last reduce-scatter has (FSDP2's final
  callback waits for them).

Ring times (plan/parallel.py): an all-gather of the unit's weights and a reduce-scatter of its
gradients, both in the model dtype (FSDP2's default policy), over N ranks; the HSDP
all-reduce of numel / N elements over R; the validation all-reduce of the engine's vector
(float64: 7 + one per trainable parameter) over all N x R ranks. There is no collective
lane in the telemetry: the collectives' time is ``SimResult.collective_s``, and what compute
waits for shows as its waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from superoffload.plan import cost, parallel
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.telemetry import events as ev

VALIDATION_HEAD = 7
"""Float64 entries of the engine's validation vector before the one per parameter
(runtime/transport.py ``validation_vector``)."""


@dataclass(frozen=True, slots=True)
class FsdpLayout:
    """Static arrays of one (shape, plan) over FSDP2 (per unit, forward order)."""

    unit_of_layer: np.ndarray
    first_layer: np.ndarray
    """The unit's first layer in forward order (its all-gather comes before it)."""
    top_layer: np.ndarray
    """Its first layer in backward order (a regathered unit's all-gather comes before it)."""
    low_layer: np.ndarray
    """Its last layer in backward order (its reduce-scatter follows that layer)."""
    all_gather_s: np.ndarray
    reduce_s: np.ndarray
    """Reduce-scatter (+ HSDP all-reduce, + a host unit's gradient copy) seconds."""
    regather: np.ndarray
    has_tail: np.ndarray
    unit_buckets: tuple[np.ndarray, ...]
    """Per unit: the host buckets holding its parameters (its all-gather waits for them)."""
    pair_bucket: np.ndarray
    pair_unit: np.ndarray
    """(host bucket, unit) pairs: the bucket is complete once every such unit has reduced."""
    bucket_on_host: np.ndarray
    """Per host bucket: every parameter's shard lives on the host (weight-flow units): its
    copies are host memory copies, not transfers."""
    validation_s: float
    blocking: bool
    lookahead: int

    @property
    def iteration_collective_s(self) -> float:
        """Seconds of the collectives of one iteration (each all-gather, reduce-scatter and
        all-reduce once as often as FSDP2 issues it, and the validation)."""
        gathers = np.where(self.regather, 2.0, 1.0)
        return float(np.sum(self.all_gather_s * gathers) + np.sum(self.reduce_s)
                     + self.validation_s)


def host_copy_s(nbytes: np.ndarray, prof: HardwareProfile) -> np.ndarray:
    """A copy between two host buffers: its bytes read and written on the host's bus."""
    return 2.0 * np.asarray(nbytes, float) / cost.host_bus_bps(prof)


def fsdp_layout(shape: ModelShape, prof: HardwareProfile, plan: Resolved,
                n_host_buckets: int) -> FsdpLayout:
    """The units of ``plan`` (the rule book's) mapped onto the layers of ``shape``."""
    assert plan.units is not None
    n, r = shape.dp, shape.dp_replicate
    top = shape.layers + 1
    layer, numel = shape.param_layout()
    units = plan.units.units
    unit_of_param = plan.units.unit_of()
    unit_of_layer = np.zeros(top + 1, dtype=np.int64)
    for i, k in enumerate(layer.tolist()):
        # the root unit (index 0, plan/fsdp_units.py) holds whatever no block unit does
        unit_of_layer[k] = unit_of_param.get(i, 0)
    nu = len(units)
    layers_of = [np.flatnonzero(unit_of_layer == u) for u in range(nu)]
    first = np.asarray([ls.min() if len(ls) else 0 for ls in layers_of])
    w = shape.dtype_bytes
    size = np.asarray([u.numel for u in units], float) * w
    on_host = np.asarray([u.on_host for u in units])
    if prof.device_type == "cuda":
        # a host-resident shard crosses the link before its all-gather and after its
        # reduce-scatter; on the CPU backend the "device" is the host: no copy
        shard_copy = cost.link_time_s_array(size / n, prof, "h2d")
        back = cost.link_time_s_array(size / n, prof, "d2h")
    else:
        shard_copy, back = np.zeros(nu), np.zeros(nu)
    ag = parallel.ring_time_s(size, n, prof) + np.where(on_host, shard_copy, 0.0)
    # HSDP: the reduce-scatter inside a replica, then the reduced shard all-reduced across
    # replicas (a ring all-reduce: twice the steps)
    rs = (parallel.ring_time_s(size, n, prof)
          + parallel.ring_time_s(size / n, r, prof, steps_factor=2)
          + np.where(on_host, back, 0.0))
    host_ids = {b.id for b in plan.bucket_plan.host_buckets}
    tail_units = {unit_of_param[i] for b in plan.bucket_plan.device_buckets
                  for i in b.param_indices if i in unit_of_param}
    unit_buckets = tuple(np.asarray(sorted(b for b in u.buckets if b in host_ids), np.int64)
                         for u in units)
    if plan.whole_model_bucket:
        # the ablation without buckets: one host bucket
        unit_buckets = tuple(np.zeros(min(len(b), 1), np.int64) for b in unit_buckets)
    pairs = [(int(b), u) for u, bs in enumerate(unit_buckets) for b in bs]
    pair_b = np.asarray([b for b, _ in pairs], np.int64)
    pair_u = np.asarray([u for _, u in pairs], np.int64)
    in_device_unit = np.zeros(n_host_buckets, bool)
    # a bucket with a parameter in a device-resident unit crosses the link: not host-only
    np.logical_or.at(in_device_unit, pair_b, ~on_host[pair_u])
    val_bytes = 8.0 * (VALIDATION_HEAD + len(numel))
    lookahead = 1
    if plan.weights == "flow":
        # weight flow prefetches prefetch_depth units ahead; FSDP2's default is one
        lookahead = max(1, plan.prefetch_depth)
    return FsdpLayout(
        unit_of_layer=unit_of_layer, first_layer=first,
        top_layer=np.asarray([ls.max() if len(ls) else 0 for ls in layers_of]),
        low_layer=first.copy(), all_gather_s=ag, reduce_s=rs,
        regather=np.asarray([u.reshard_after_forward for u in units]),
        has_tail=np.asarray([u in tail_units for u in range(nu)]),
        unit_buckets=unit_buckets, pair_bucket=pair_b, pair_unit=pair_u,
        bucket_on_host=~in_device_unit,
        validation_s=parallel.all_reduce_time_s(val_bytes, n * r, prof),
        blocking=parallel.collective_backend(prof) == "gloo",
        lookahead=lookahead)


def walk(fl: FsdpLayout, fwd_t: list[float], bwd_t: list[float], it: int, t: float,
         comm_free: float, ready_next: np.ndarray, tail_ready: float
         ) -> tuple[float, np.ndarray, float, list]:
    """One iteration's forward and backward from ``t`` (module docstring): (backward end,
    the time each host bucket's gradients are complete, the communication stream's next
    free time, span chunks). ``ready_next``: when each host bucket's publish lands."""
    n_layers = len(fwd_t)
    nu = len(fl.first_layer)
    # a unit's gather waits for the latest publish of its host buckets (none: no wait)
    need = np.asarray([float(ready_next[bs].max()) if len(bs) else 0.0
                       for bs in fl.unit_buckets])
    c_start = np.empty(2 * n_layers)
    c_end = np.empty(2 * n_layers)
    waits_s: list[float] = []
    waits_e: list[float] = []
    comm = comm_free

    def collective(ready: float, issue: float, dur: float) -> float:
        """End of one collective issued at ``issue`` that may start once ``ready``."""
        nonlocal t, comm
        if fl.blocking:
            # gloo: the training thread runs it
            end = max(t, ready) + dur
        else:
            # NCCL: FSDP2's communication stream, one collective at a time
            end = max(comm, ready, issue) + dur
            comm = end
        return end

    def wait_until(end: float) -> None:
        nonlocal t
        if end > t:
            waits_s.append(t)
            waits_e.append(end)
            t = end

    t0 = t
    unit_starts: list[float] = []
    for li in range(n_layers):
        u = fl.unit_of_layer[li]
        if fl.first_layer[u] == li:
            # the unit's pre-forward: wait for publishes, gather
            k = len(unit_starts)
            # FSDP2 issues a unit's all-gather when the unit `lookahead` before it starts;
            # the first ones at the start of forward
            issue = t0
            if k >= fl.lookahead:
                issue = unit_starts[k - fl.lookahead]
            # a unit holding device-stepped parameters also waits for the tail step
            ready = max(need[u], tail_ready if fl.has_tail[u] else 0.0)
            wait_until(collective(ready, issue, float(fl.all_gather_s[u])))
            unit_starts.append(t)
        c_start[li] = t
        t += fwd_t[li]
        c_end[li] = t
    reduced = np.zeros(nu)
    prev_start = t
    for j, li in enumerate(reversed(range(n_layers))):
        u = fl.unit_of_layer[li]
        if fl.regather[u] and fl.top_layer[u] == li:
            # resharded after forward (weight flow): gathered again, issued when the
            # previous layer's backward began
            wait_until(collective(t, prev_start, float(fl.all_gather_s[u])))
        prev_start = t
        c_start[n_layers + j] = t
        t += bwd_t[li]
        c_end[n_layers + j] = t
        if fl.low_layer[u] == li:
            # the unit's post-backward: reduce-scatter
            end = collective(t, t, float(fl.reduce_s[u]))
            if fl.blocking:
                wait_until(end)
            reduced[u] = end
    # FSDP2's final callback waits for the reduce-scatters
    bwd_end = max(t, comm)
    wait_until(bwd_end)
    grad_ready = np.zeros(len(fl.bucket_on_host))
    np.maximum.at(grad_ready, fl.pair_bucket, reduced[fl.pair_unit])
    chunks = [(ev.LANE_COMPUTE, ev.KIND_FORWARD, c_start[:n_layers], c_end[:n_layers], it,
               None, 0),
              (ev.LANE_COMPUTE, ev.KIND_BACKWARD, c_start[n_layers:], c_end[n_layers:], it,
               None, 0),
              (ev.LANE_COMPUTE, ev.KIND_WAIT, waits_s, waits_e, it, None, 0)]
    return bwd_end, grad_ready, comm, chunks


def micro_step_collective_s(fl: FsdpLayout, compute_s: float, reduces: bool) -> float:
    """Seconds one accumulating micro-step adds to its compute: its all-gathers (and
    reduce-scatters when every micro-step reduces) -- all of it on gloo, what compute cannot
    hide on NCCL."""
    # a resharded unit is gathered for forward and again for backward
    gathers = np.where(fl.regather, 2.0, 1.0)
    reduce_s = float(np.sum(fl.reduce_s)) if reduces else 0.0
    comm = float(np.sum(fl.all_gather_s * gathers)) + reduce_s
    if fl.blocking:
        # gloo runs on the training thread: nothing overlaps compute
        return comm
    return max(0.0, comm - compute_s)
