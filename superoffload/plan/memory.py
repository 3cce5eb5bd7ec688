"""Memory per side for each policy, and the largest model a machine can train with it.

Bytes per parameter (DESIGN.md §1; mixed-precision Adam, Rajbhandari et al. 2020 "ZeRO" §3);
``w`` is the model dtype's size (bf16/fp16 2, fp32 4):
  weights             device: w per parameter (stationary); weight-flow keeps the GPU tail's,
                      the embeddings, final norm and head, and (prefetch_depth + 1) of the
                      largest blocks' (paper §4.5; runtime/weightflow.py streams the blocks)
  gradients           device: plan/device_grads.py, the engine's rule: the tail's w per
                      parameter until zero_grad(); the offloaded ones leave with their bucket,
                      at most (grad_buckets_in_flight + 1) host buckets at once (all of them
                      when kept, or accumulating on the device)
  GPU tail state      device: fp32 master (none for an fp32 model: the weights are the master)
                      + m + v in fp32: 12 B (fp32 model 8 B); its fused step widens a
                      bucket's low-precision gradients to fp32 (4 B per element of the largest
                      tail bucket, a transient of the step; kernels/device_adam.py)
  offloaded params    host:   16 (fp32 master, m, v, grad buffer) + 2 (pinned bf16 weight copy)
                              + 12 with snapshot rollback (pre-step p, m, v; DESIGN.md §4);
                              bf16 moments (optimizer_state_dtype="bf16", docs/kernel.md):
                              m and v take 2 + 2 instead of 4 + 4, so 12 + 2, snapshot 8
  staging             fp32 copies of two buckets per direction cast on the device (double
                      buffering; the largest bucket of the engine's table); none for a
                      direction cast on the host, none for an fp32 model (nothing to cast)
  activations         what autograd keeps, per layer (ModelShape.layer_activation_bytes)

The device figure is the peak over one iteration, not a sum of everything: backward walks the
layers from the head down, freeing each layer's activations after its backward while its
gradients arrive (a tied head's gradient arrives with the head). At each layer the device
holds its resident buffers, the activations of the layers not yet done (+ one recomputed
block with checkpointing, + the loss's fp32 gradients at the head: an allocator transient),
and the gradients the rule keeps by then; after backward, the tail step holds the gradients
and its fp32 temporaries. With grad_accum_steps > 1 the gradients that accumulate on the
device are resident from the start (a later micro-step). ``Memory.device_kept`` is the same
peak without the transients: what live tensors hold (tests/test_plan_device_memory.py holds it
to the engine's DeviceMeter within 10%).
Data parallel (ModelShape.dp = N > 1, the "superoffload" schedule): bytes per rank over
FSDP2, plan/memory_fsdp.py (shards, FSDP2's unsharded weights and gradients at their moments,
its reduce-scatter buffer). With ranks_per_host > 1 the fit check uses the rank's share of
the host (plan/parallel.rank_profile). The "gpu" schedule with data parallel replicates
everything (DDP): the figures below, per rank.
Headroom: 5% of device memory (allocator fragmentation, CUDA context) and 10% of host memory
(the OS, the data pipeline) are kept free -- estimates, not measurements.
"""

from __future__ import annotations

import numpy as np

from superoffload.plan.device_grads import DeviceGrads, device_grads
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory_host import host_side, staging_bytes_per_element
from superoffload.plan.memory_types import Memory
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape

DEVICE_HEADROOM = 0.95
HOST_HEADROOM = 0.90


def offloaded_params(shape: ModelShape, plan: Resolved) -> float:
    """Parameters whose fp32 state lives on the host: the whole host buckets of the engine's
    bucket table (plan.schedule rule book), as the engine and the simulator offload them."""
    if plan.system == "gpu":
        return 0.0
    return float(plan.host_numel)


def largest_host_bucket(plan: Resolved) -> float:
    """Elements of the largest offloaded bucket (a parameter larger than bucket_bytes is a
    bucket of its own, so it can exceed bucket_bytes / 4); all of them without buckets."""
    if plan.whole_model_bucket:
        return float(plan.host_numel)
    return float(max((b.numel for b in plan.bucket_plan.host_buckets), default=0))


def grads_of(shape: ModelShape, plan: Resolved) -> DeviceGrads:
    """The device-gradient rule (plan/device_grads.py) for a resolved schedule."""
    if plan.system == "gpu":
        host: list[int] = []
    elif plan.whole_model_bucket:
        host = [plan.host_numel]
    else:
        host = [b.numel for b in plan.bucket_plan.host_buckets]
    tail = plan.bucket_plan.total_numel - sum(host)
    return device_grads(host, tail, grad_buckets_in_flight=plan.grad_buckets_in_flight,
                        keep_device_grads=plan.keep_device_grads,
                        grad_accum_steps=plan.grad_accum_steps, grad_accum_on=plan.grad_accum_on,
                        streamed_numel=streamed_numel(shape, plan))


def streamed_numel(shape: ModelShape, plan: Resolved) -> int:
    """Elements weight-flow streams: the blocks' (everything else stays resident)."""
    if plan.weights != "flow" or plan.system == "gpu":
        return 0
    return int(sum(shape.layer_params()[1:-1]))


def memory(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> Memory:
    """Per-side bytes for `shape` under the resolved schedule `plan` (per rank when dp > 1).
    The "zero-offload" schedule is DeepSpeed's, with its own buffers (plan/deepspeed.py)."""
    if plan.system == "zero-offload":
        from superoffload.plan.deepspeed import zero2_memory

        return zero2_memory(shape, plan)
    if plan.units is not None:
        # data parallel over FSDP2: sharded state, per-unit gathers (plan/memory_fsdp.py)
        from superoffload.plan.memory_fsdp import fsdp_memory

        return fsdp_memory(shape, prof, plan)
    n = float(shape.params)
    off = offloaded_params(shape, plan)
    tail = n - off
    w = shape.dtype_bytes
    # an fp32 model casts nothing: no fp32 copies
    low = shape.dtype != "float32"
    resident: dict[str, float] = {}
    if plan.weights == "flow" and off > 0:
        # blocks stream, (prefetch_depth + 1) at a time; embeddings, final norm and head stay
        per_layer = shape.layer_params()
        edge = per_layer[0] + per_layer[-1]
        # the largest blocks bound the in-flight ones whichever are fetched together
        blocks = (plan.prefetch_depth + 1) * max(per_layer[1:-1], default=0)
        # never more than the whole model: a tail can already hold most of the blocks
        resident["weights"] = min(w * n, w * tail + w * (edge + blocks))
    else:
        resident["weights"] = w * n
    # fp32 master + m + v; an fp32 model's weights are the master: m and v only
    resident["tail_state"] = (12.0 if low else 8.0) * tail
    resident["staging"] = 0.0
    if off > 0:
        # fp32 copies made on the device for device-side casting, two buckets in flight
        bucket_params = largest_host_bucket(plan)
        resident["staging"] = 2.0 * staging_bytes_per_element(plan, low) * bucket_params
    grads = grads_of(shape, plan)
    temporaries = 0.0
    if low and prof.device_type == "cuda" and grads.tail_numel:
        # the fused CUDA step widens one bucket's low-precision gradients to fp32 at a time
        # (module docstring); the "gpu" schedule's every bucket is a tail bucket
        if plan.system == "gpu":
            tail_buckets = plan.bucket_plan.buckets
        else:
            tail_buckets = plan.bucket_plan.device_buckets
        temporaries = 4.0 * max((b.numel for b in tail_buckets), default=0)
    parts, kept = _device_peak(shape, plan, resident, grads, w, temporaries)
    # the engine's rule for what it keeps (plan/storage.py)
    side = host_side(shape, plan)
    return Memory(sum(parts.values()), sum(side.host_parts.values()), parts, side.host_parts,
                  device_kept=kept, storage=sum(side.storage_parts.values()),
                  storage_parts=side.storage_parts, refusal=side.refusal)


def _device_peak(shape: ModelShape, plan: Resolved, resident: dict[str, float],
                 grads: DeviceGrads, w: float, temporaries: float
                 ) -> tuple[dict[str, float], float]:
    """(the device's parts at its peak moment, the peak without transients): backward layer by
    layer from the head, then the tail step (module docstring)."""
    layer, numel = shape.param_layout()
    top = shape.layers + 1
    arrival = layer.copy()
    if shape.tied_embeddings:
        # the tied head's gradient first arrives with the head (the first layer backward runs)
        tied = np.flatnonzero((layer == 0) & (numel == shape.vocab * shape.hidden))
        arrival[tied[:1]] = top
    on_host = np.zeros(len(numel), dtype=bool)
    if plan.system != "gpu":
        for b in plan.bucket_plan.host_buckets:
            on_host[list(b.param_indices)] = True
    # gradients arrived once layer k's backward has run (k = top .. 0): a reverse cumsum
    by_layer = np.bincount(arrival, weights=numel * ~on_host, minlength=top + 1)
    tail_arrived = np.cumsum(by_layer[::-1])[::-1]
    off_arrived = np.cumsum(np.bincount(arrival, weights=numel * on_host,
                                        minlength=top + 1)[::-1])[::-1]
    if grads.accumulating:  # a later micro-step: the tail's gradients are all there
        tail_arrived = np.full(top + 1, float(grads.tail_numel))
    off_res = np.asarray([grads.offloaded_resident_numel(a) for a in off_arrived])
    grad_bytes = w * (tail_arrived + off_res)
    # after layer k's backward, layers 0..k-1 still hold theirs: a forward cumsum, read at k
    act = np.cumsum(np.asarray(shape.layer_activation_bytes()))
    # only the blocks (1..layers) recompute under checkpointing
    recompute = np.zeros(top + 1)
    recompute[1:top] = shape.recompute_bytes()
    # the loss's fp32 gradients exist only while the head's backward runs
    loss = np.zeros(top + 1)
    loss[top] = shape.loss_transient_bytes()
    step_grads = w * (grads.tail_numel + grads.kept_numel)
    # the moments: backward after layer k (k = 0..top), then the tail step
    moments_act = np.append(act + recompute, 0.0)
    moments_grad = np.append(grad_bytes, step_grads)
    moments_loss = np.append(loss, 0.0)
    moments_temp = np.append(np.zeros(top + 1), temporaries)
    kept_all = moments_act + moments_grad
    total = kept_all + moments_loss + moments_temp
    at = int(np.argmax(total))
    parts = dict(resident)
    activations = recomputed = 0.0
    if at <= top:
        # a backward moment; at == top + 1 is the tail step, after every activation is freed
        activations, recomputed = float(act[at]), float(recompute[at])
    parts.update(grads=float(moments_grad[at]), activations=activations, recompute=recomputed,
                 loss_transient=float(moments_loss[at]), step_temporaries=float(moments_temp[at]))
    return parts, sum(resident.values()) + float(kept_all.max())


def fit_sides(mem: Memory, prof: HardwareProfile) -> tuple[bool, bool]:
    """(device side fits, host side fits), the two predicates ``check_fits`` words. On one
    pool (``shared_memory``) the pool is the host side and the device side always fits. The
    host side includes the storage tier: its files fit the tier, and the engine would not
    refuse the budget."""
    # 10% stays free for the OS and the data pipeline (module docstring, "Headroom")
    host_cap = prof.host_memory_bytes * HOST_HEADROOM
    tier_ok = not mem.refusal and mem.storage <= prof.storage_bytes
    if prof.shared_memory:
        return True, mem.device + mem.host <= host_cap and tier_ok
    return (mem.device <= prof.device_memory_bytes * DEVICE_HEADROOM,
            mem.host <= host_cap and tier_ok)


def _gb(nbytes: float) -> str:
    """Whole GB from 10 GB up, three significant digits below (a small cap still reads)."""
    # 9.5e9: where .0f starts printing "10", so whole GB begin at what reads as 10
    if nbytes >= 9.5e9:
        return f"{nbytes / 1e9:.0f}"
    return f"{nbytes / 1e9:.3g}"


def check_fits(mem: Memory, prof: HardwareProfile) -> list[str]:
    """Reasons the memory does not fit the profile (empty when it fits): ``fit_sides`` in
    words."""
    problems = []
    if mem.refusal:
        problems.append(mem.refusal)
    if mem.storage > prof.storage_bytes:
        # a profile without a tier has 0 bytes: say how to name one rather than "has 0"
        fix = "" if prof.has_storage else " (no storage tier: --storage names one)"
        problems.append(f"needs {_gb(mem.storage)} GB on the storage tier, profile "
                        f"{prof.name} has {_gb(prof.storage_bytes)}" + fix)
    device_fits, _ = fit_sides(mem, prof)
    dev_cap = prof.device_memory_bytes * DEVICE_HEADROOM
    host_cap = prof.host_memory_bytes * HOST_HEADROOM
    host_need = mem.host
    if prof.shared_memory:
        # one pool: the device's bytes are host bytes too
        host_need = mem.device + mem.host
    host_fits = host_need <= host_cap
    if prof.shared_memory:
        total = mem.device + mem.host
        if not host_fits:
            problems.append(f"needs {_gb(total)} GB of shared memory (device + host), "
                            f"profile {prof.name} has {_gb(host_cap)} usable")
        return problems
    if not device_fits:
        problems.append(f"needs {_gb(mem.device)} GB device memory, profile {prof.name} "
                        f"has {_gb(dev_cap)} usable of {_gb(prof.device_memory_bytes)}")
    if not host_fits:
        copies = mem.host_parts.get("rollback_snapshot", 0.0)
        hint = ""
        if copies:
            # the pre-step copies are a choice, not a need: name the setting that drops them
            hint = (f", {_gb(copies)} GB of it pre-step copies of the state (rollback="
                    "'snapshot', or 'auto' in the first steps; rollback='inverse' keeps none)")
        problems.append(f"needs {_gb(mem.host)} GB host memory, profile {prof.name} has "
                        f"{_gb(host_cap)} usable of {_gb(prof.host_memory_bytes)}{hint}")
    return problems
