"""Memory per rank under data parallel over FSDP2 (``FsdpOffloadEngine``; plan/memory.py
does one process; the units: plan/fsdp_units.py).

With N = ``ModelShape.dp`` shard ranks and ``w`` the model dtype's bytes, one rank holds:

  device, always    its shards of every device-resident unit's weights (w numel / N: all of
                    them weight-stationary, the root's under weight-flow, whose block shards
                    live on the host); the GPU tail's fp32 state over its shards (12 B, an fp32
                    model 8 B, per tail element / N); casting staging for two shards in flight
  device, a moment  FSDP2's unsharded weights (all-gather outputs, w per element): the root's
                    through the whole iteration; a weight-stationary unit's from its forward to
                    the end of its backward (``reshard_after_forward=False``); under weight-flow
                    the block unit in backward and the one FSDP2 prefetches after it; in
                    forward also the flat all-gather output of the unit gathered last (FSDP2
                    frees it at the next unit's copy-out, the last at the root's post-forward)
                    FSDP2's unsharded gradients: a unit's accumulate (w per element) until its
                    reduce-scatter, the root's from the head's backward to the end (it reduces
                    last); with gradient accumulation on the device every unit's unsharded
                    gradients stay across micro-steps (no-sync), reduced on the last one
                    the reduce-scatter input of the unit reduced last (w per element of it: FSDP2
                    keeps one until the next unit reduces, all freed when backward ends)
                    the sharded gradients (w numel / N) under the engine's rule
                    (plan/device_grads.py): the tail's until ``zero_grad()``, offloaded ones
                    leaving with their bucket; they arrive when their unit reduces
                    activations as one process holds them (plan/memory.py)
  host              the engine's buffers over its shards (plan/memory.py's bytes / N); under
                    weight-flow also the block units' shards (w numel / N)

The device figure is the peak over backward's moments (layer by layer from the head, as
plan/memory.py walks them) and the step after it; ``device_kept`` leaves out the allocator's
transients (the loss's fp32 gradients, the tail step's temporaries) and the momentary
all-gather and copy-in buffers. FSDP2's shards are dim-0 slices padded to N rows: counted as
numel / N. A unit's unsharded buffers use the model dtype (FSDP2's default
``MixedPrecisionPolicy``; a policy with another ``param_dtype`` is not modelled).
"""

from __future__ import annotations

import numpy as np

from superoffload.plan.device_grads import device_grads
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory_host import host_side, staging_bytes_per_element
from superoffload.plan.memory_types import Memory
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape


def fsdp_memory(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> Memory:
    """Per-rank bytes of ``shape`` under ``plan`` over FSDP2 (module docstring)."""
    assert plan.units is not None
    n = shape.dp
    w = shape.dtype_bytes
    low = shape.dtype != "float32"
    layer, numel = shape.param_layout()
    numel = numel.astype(float)
    top = shape.layers + 1
    units = plan.units.units
    unit_of = plan.units.unit_of()
    # the root unit (index 0) holds whatever no block unit does
    uid = np.asarray([unit_of.get(i, 0) for i in range(len(numel))], np.int64)
    nu = len(units)
    u_numel = np.bincount(uid, weights=numel, minlength=nu)
    u_host = np.asarray([u.on_host for u in units])
    # a unit reduces after the backward of its lowest layer (an empty unit: layer 0)
    u_low = np.asarray([layer[uid == u].min() if np.any(uid == u) else 0 for u in range(nu)])
    on_host_bucket = np.zeros(len(numel), bool)
    for b in plan.bucket_plan.host_buckets:
        on_host_bucket[list(b.param_indices)] = True
    off = float(numel[on_host_bucket].sum())
    tail = float(numel.sum()) - off

    # fp32 master + m + v (an fp32 model's weights are the master: 8 B), sharded n ways
    tail_state_bytes = 12.0 if low else 8.0
    resident = {"weights": w * float(u_numel[~u_host].sum()) / n,
                "tail_state": tail_state_bytes * tail / n, "staging": 0.0}
    host_numels = [b.numel for b in plan.bucket_plan.host_buckets]
    if plan.whole_model_bucket and host_numels:
        # the ablation without buckets: one bucket of everything offloaded
        host_numels = [sum(host_numels)]
    largest_shard = float(np.ceil(max(host_numels, default=0) / n))
    # fp32 copies for each direction cast on the device (§4.4), two shards in flight
    resident["staging"] = 2.0 * staging_bytes_per_element(plan, low) * largest_shard

    # backward at layer k, k = 0..top
    moments = np.arange(top + 1)
    # unsharded weights: which units are gathered while layer k runs backward
    unit_of_layer = np.zeros(top + 1, np.int64)
    unit_of_layer[layer] = uid
    gathered = np.zeros((top + 1, nu), bool)
    # the root: the whole iteration (FSDP2 never reshards it after forward)
    gathered[:, 0] = True
    if u_host.any():
        # weight-flow: the unit in backward and the one prefetched after it
        gathered[moments, unit_of_layer] = True
        gathered[moments[1:], unit_of_layer[:-1]] = True
        gathered[:, 0] = True
    else:
        # stationary: every unit until its reduce-scatter
        gathered |= u_low[None, :] <= moments[:, None]
    unsharded_w = w * (gathered * u_numel[None, :]).sum(axis=1)
    # unsharded gradients: arrived (by layer; a tied head's with the head) and not yet
    # reduced, at the start and at the end of layer k's backward
    arrival = layer.copy()
    if shape.tied_embeddings:
        # the tied weight is registered once, with the embedding (layer 0)
        tied = np.flatnonzero((layer == 0) & (numel == shape.vocab * shape.hidden))
        arrival[tied[:1]] = top
    accumulating = plan.grad_accum_steps > 1 and plan.grad_accum_on == "device"
    # (moment, param): its unit has reduced
    reduced = u_low[uid][None, :] > moments[:, None]
    if accumulating:
        # no-sync: every unit's unsharded gradients from earlier micro-steps
        ug_start = ug_end = w * (~reduced * numel[None, :]).sum(axis=1)
    else:
        # arrival > k: produced before layer k's backward; >= k: by its end
        ug_start = w * (((arrival[None, :] > moments[:, None]) & ~reduced) @ numel)
        ug_end = w * (((arrival[None, :] >= moments[:, None]) & ~reduced) @ numel)
    # FSDP2's reduce-scatter input of the unit reduced last before moment k
    rs_input = np.zeros(top + 1)
    for k in moments:
        done = np.flatnonzero(u_low > k)
        if len(done):
            # the smallest u_low above k: the unit reduced most recently
            rs_input[k] = w * u_numel[done[np.argmin(u_low[done])]]
    # sharded gradients: they arrive when their unit reduces (the engine's rule on shards)
    streamed = float(numel[u_host[uid]].sum())
    rule = device_grads([int(np.ceil(x / n)) for x in host_numels], int(np.ceil(tail / n)),
                        grad_buckets_in_flight=plan.grad_buckets_in_flight,
                        keep_device_grads=plan.keep_device_grads, grad_accum_steps=1,
                        grad_accum_on="device", streamed_numel=int(np.ceil(streamed / n)))
    tail_arrived = (reduced & ~on_host_bucket[None, :]) @ numel / n
    if plan.grad_accum_steps > 1 and not accumulating:
        # reduced every micro-step: the tail's shards carry over from earlier ones
        tail_arrived = np.full(top + 1, tail / n)
    off_arrived = (reduced & on_host_bucket[None, :]) @ numel / n
    off_res = np.asarray([rule.offloaded_resident_numel(a) for a in off_arrived])
    sharded_g = w * (tail_arrived + off_res)

    layer_act = np.asarray(shape.layer_activation_bytes())
    # layers 0..k not yet done
    act = np.cumsum(layer_act)
    recompute = np.zeros(top + 1)
    recompute[1:top] = shape.recompute_bytes()
    loss = np.zeros(top + 1)
    loss[top] = shape.loss_transient_bytes()
    temporaries = 0.0
    if low and prof.device_type == "cuda" and tail > 0:
        # the fused step widens the largest tail bucket's shard to fp32 (plan/memory.py)
        largest_tail = max((b.numel for b in plan.bucket_plan.device_buckets), default=0)
        temporaries = 4.0 * float(np.ceil(largest_tail / n))
    # the end of forward: FSDP2 frees a unit's all-gather output (the flat buffer its
    # parameters are copied out of) only at the next unit's copy-out, and the last one at
    # the root's post-forward; weight-flow's prefetched gathers free theirs at once
    if u_host.any():
        # the root and the last block's unit (a model without blocks: the root only)
        last_unit = u_numel[unit_of_layer[top - 1]] if top > 1 else 0.0
        fwd_w = w * (u_numel[0] + last_unit)
    else:
        fwd_w = float(unsharded_w[top]) + w * float(u_numel[-1])
    # the moments: the end of forward; the start of layer k's backward, its end (its
    # activations freed, its gradients there), k = 0..top; then the step (every unit
    # resharded, buffers released)
    none, zero = np.zeros(top + 1), [0.0]
    m_weights = np.concatenate([[fwd_w], unsharded_w, unsharded_w, zero])
    m_grads = np.concatenate([[sharded_g[top] + ug_start[top]], sharded_g + ug_start,
                              sharded_g + ug_end, [w * (rule.tail_numel + rule.kept_numel)]])
    m_rs = np.concatenate([zero, rs_input, rs_input, zero])
    m_act = np.concatenate([[act[top]], act, act - layer_act, zero])
    m_recompute = np.concatenate([zero, recompute, none, zero])
    m_loss = np.concatenate([zero, loss, none, zero])
    m_temp = np.concatenate([zero, none, none, [temporaries]])
    kept_all = m_weights + m_grads + m_rs + m_act + m_recompute
    at = int(np.argmax(kept_all + m_loss + m_temp))
    parts = dict(resident)
    parts.update(weights=resident["weights"] + float(m_weights[at]), grads=float(m_grads[at]),
                 collective_buffers=float(m_rs[at]), activations=float(m_act[at]),
                 recompute=float(m_recompute[at]), loss_transient=float(m_loss[at]),
                 step_temporaries=float(m_temp[at]))
    kept = sum(resident.values()) + float(kept_all.max())

    # the engine's buffers over this rank's shards, by its own rule (plan/memory_host.py);
    # nothing offloaded: no host buffers, no tier
    host: dict[str, float] = {}
    storage: dict[str, float] = {}
    refusal = ""
    if off > 0:
        side = host_side(shape, plan, n)
        host, storage, refusal = dict(side.host_parts), side.storage_parts, side.refusal
    if u_host.any():
        host["weights_host_shards"] = w * float(u_numel[u_host].sum()) / n
    return Memory(sum(parts.values()), sum(host.values()), parts, host, device_kept=kept,
                  storage=sum(storage.values()), storage_parts=storage, refusal=refusal)
