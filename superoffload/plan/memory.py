"""Memory per side for each policy, and the largest model a machine can train with it.

Bytes per parameter (DESIGN.md §1; mixed-precision Adam, Rajbhandari et al. 2020 "ZeRO" §3):
  plain GPU           device: 2 (bf16 weight) + 2 (bf16 grad) + 16 (fp32 master, m, v, grad)
  offloaded params    device: 2 (bf16 weight, stationary) + 2 (bf16 grad until its bucket leaves)
                      host:   16 (fp32 master, m, v, grad buffer) + 2 (pinned bf16 weight copy)
                              + 12 with snapshot rollback (pre-step p, m, v; DESIGN.md §4);
                              bf16 moments (optimizer_state_dtype="bf16", docs/kernel.md):
                              m and v take 2 + 2 instead of 4 + 4, so 12 + 2, snapshot 8
  GPU tail params     device: 2 + 2 + 16 (like plain GPU)
  weight-flow         device keeps only (prefetch_depth + 1) layers of bf16 weights (paper §4.5);
                      the bf16 copy of offloaded weights lives on the host (the 2 B above)
  staging             fp32 copies of two buckets per direction cast on the device (double
                      buffering; the largest bucket of the engine's table); none for a
                      direction cast on the host, none for an fp32 model (nothing to cast)
  activations         ModelShape.activation_bytes()
Data parallel (ModelShape.dp = N > 1; ZeRO §5, distributed/zero.py): bytes are per rank. The
host's fp32 state, pinned bf16 copy and snapshot are divided by N (each rank holds its shard);
weight-flow still needs the whole bf16 model on each host. The device keeps replicated bf16
weights, gradients and the (replicated) tail state, plus the fp32 flat buffers of two buckets
in flight for the reduce-scatter (the engine reduces in fp32). With ranks_per_host > 1 the
fit check uses the rank's share of the host (plan/parallel.rank_profile).
Headroom: 5% of device memory (allocator fragmentation, CUDA context) and 10% of host memory
(the OS, the data pipeline) are kept free -- estimates, not measurements.
"""

from __future__ import annotations

from superoffload.plan.memory_types import Memory
from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape

DEVICE_HEADROOM = 0.95
HOST_HEADROOM = 0.90
MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0}
"""Bytes per parameter of one Adam moment on the host, by OffloadConfig.optimizer_state_dtype."""


def offloaded_params(shape: ModelShape, plan: Resolved) -> float:
    """Parameters whose fp32 state lives on the host: the whole host buckets of the engine's
    bucket table (plan.schedule rule book), as the engine and the simulator offload them."""
    if plan.schedule == "gpu":
        return 0.0
    return float(plan.host_numel)


def largest_host_bucket(plan: Resolved) -> float:
    """Elements of the largest offloaded bucket (a parameter larger than bucket_bytes is a
    bucket of its own, so it can exceed bucket_bytes / 4); all of them without buckets."""
    if plan.whole_model_bucket:
        return float(plan.host_numel)
    return float(max((b.numel for b in plan.bucket_plan.host_buckets), default=0))


def memory(shape: ModelShape, prof: HardwareProfile, plan: Resolved) -> Memory:
    """Per-side bytes for `shape` under the resolved schedule `plan` (per rank when dp > 1).
    The "zero-offload" schedule is DeepSpeed's, with its own buffers (plan/deepspeed.py)."""
    if plan.schedule == "zero-offload":
        from superoffload.plan.deepspeed import zero2_memory

        return zero2_memory(shape, plan)
    n = float(shape.params)
    off = offloaded_params(shape, plan)
    tail = n - off
    dev: dict[str, float] = {}
    host: dict[str, float] = {}
    if plan.weights == "flow" and off > 0:
        biggest = max(shape.layer_params())
        dev["weights_bf16"] = 2.0 * tail + 2.0 * (plan.prefetch_depth + 1) * biggest
        dev["grads_bf16"] = 2.0 * tail + 2.0 * biggest
    else:
        dev["weights_bf16"] = 2.0 * n
        dev["grads_bf16"] = 2.0 * n
    dev["tail_fp32_state"] = 16.0 * tail
    if off > 0:
        # fp32 copies made on the device for device-side casting, two buckets in flight
        bucket_params = largest_host_bucket(plan)
        low = plan.model_dtype != "float32"  # an fp32 model casts nothing: no fp32 copies
        per_param = (4.0 if plan.grad_cast == "device" and low else 0.0) + (
            4.0 if plan.param_cast == "device" and low else 0.0)
        dev["staging"] = 2.0 * per_param * bucket_params
        if shape.dp > 1:
            dev["collective_buffers"] = 2.0 * 4.0 * bucket_params
    dev["activations"] = shape.activation_bytes()
    if off > 0:
        shard = off / shape.dp if shape.dp > 1 else off
        moments = 2.0 * MOMENT_BYTES[plan.optimizer_state_dtype]  # m and v
        if plan.optimizer_state_dtype == "fp32":
            host["fp32_state"] = (8.0 + moments) * shard  # master, gradient buffer, m, v
        else:
            host["fp32_state"] = 8.0 * shard  # master and gradient buffer
            host["bf16_moments"] = moments * shard
        host["weights_bf16_pinned"] = 2.0 * (shard if plan.weights != "flow" else n)
        if plan.speculate and plan.snapshot_rollback:
            host["rollback_snapshot"] = (4.0 + moments) * shard  # pre-step p, m, v
    return Memory(sum(dev.values()), sum(host.values()), dev, host)


def fit_sides(mem: Memory, prof: HardwareProfile) -> tuple[bool, bool]:
    """(device side fits, host side fits), the two predicates ``check_fits`` words. On one
    pool (``shared_memory``) the pool is the host side and the device side always fits."""
    host_cap = prof.host_memory_bytes * HOST_HEADROOM
    if prof.shared_memory:
        return True, mem.device + mem.host <= host_cap
    return (mem.device <= prof.device_memory_bytes * DEVICE_HEADROOM, mem.host <= host_cap)


def check_fits(mem: Memory, prof: HardwareProfile) -> list[str]:
    """Reasons the memory does not fit the profile (empty when it fits): ``fit_sides`` in
    words."""
    problems = []
    device_fits, host_fits = fit_sides(mem, prof)
    dev_cap = prof.device_memory_bytes * DEVICE_HEADROOM
    host_cap = prof.host_memory_bytes * HOST_HEADROOM
    if prof.shared_memory:
        total = mem.device + mem.host
        if not host_fits:
            problems.append(f"needs {total / 1e9:.0f} GB of shared memory (device + host), "
                            f"profile {prof.name} has {host_cap / 1e9:.0f} usable")
        return problems
    if not device_fits:
        problems.append(f"needs {mem.device / 1e9:.0f} GB device memory, profile {prof.name} "
                        f"has {dev_cap / 1e9:.0f} usable of {prof.device_memory_bytes / 1e9:.0f}")
    if not host_fits:
        problems.append(f"needs {mem.host / 1e9:.0f} GB host memory, profile {prof.name} has "
                        f"{host_cap / 1e9:.0f} usable of {prof.host_memory_bytes / 1e9:.0f}")
    return problems
