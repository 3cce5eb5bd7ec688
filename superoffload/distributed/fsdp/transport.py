"""PROTOTYPE: the offload engine's transport over FSDP2 (issue 21 §5; docs/distributed.md,
"FSDP2 under the engine").

FSDP2 (``torch.distributed.fsdp.fully_shard``) already moves what ``ZeroTransport`` moves:
it reduce-scatters each unit's gradients in backward and all-gathers its weights before the
unit's next forward. So this transport issues NO collective per bucket. It rides FSDP2's
hooks instead:

* gradients: FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after it
  wrote the reduce-scattered (averaged, so ``grad_divisor`` = 1) shard into ``.grad``
  (torch 2.13 ``_fsdp_collectives.foreach_reduce``; with CPUOffloadPolicy the D2H copy is
  then synchronous). The engine's own hook (runtime/hooks.py) therefore sees each parameter
  as final once, and a bucket launches when all of its parameters' units have reduced.
  ``launch`` copies the LOCAL shards of the gradients into the bucket's host buffer (the
  engine's D2H task) and returns their partial statistics;
* the CPU step and STV are the engine's, over this rank's local shards (each rank owns
  FSDP2's dim-0 shard of every parameter, possibly empty);
* validation: one all-reduce of [sum of squares, non-finite count, which parameters had a
  gradient] (the shards are disjoint, so the sum is exact);
* weights: ``publish`` copies the stepped fp32 master (or its bf16 copy) into the
  DTensor's local shard (the engine's H2D task), the memory FSDP2 all-gathers from. FSDP2
  all-gathers a unit in ITS forward pre-hook, before the engine's per-module wait hooks
  run, so this transport adds a forward pre-hook with ``prepend=True`` on every FSDP module
  that waits for the last publish of the buckets holding that unit's parameters.

Limits of the prototype (each refused with a message at ``build``): every bucket offloaded
(``ratio=1.0``: no GPU tail), weight-stationary only, the CPU device (gloo; the CUDA path
would need the H2D copy ordered before FSDP2's all-gather stream, not tried). Checkpoints:
``export_states`` gathers full tensors (collective); the engine's single-process checkpoint
files are not sharded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any
from typing import cast as typed

import torch
import torch.distributed as dist

from superoffload.distributed.zero.comm import agree_fingerprint, all_reduce_validation
from superoffload.kernels.optimizer_batches import is_dtensor, local_shard, state_like
from superoffload.plan.buckets import Bucket, BucketPlan
from superoffload.runtime.backend import GradStats
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.local_transport import LocalTransport
from superoffload.runtime.state import BucketBuffers, ParamState, adopt_value, build_buffers
from superoffload.runtime.transfers import D2HTask, wait_for
from superoffload.runtime.transport import (
    NO_CHECKS,
    Checks,
    GlobalStats,
    Published,
    TransportContext,
)
from superoffload.runtime.worker import Priority


def fsdp_units(model: torch.nn.Module) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """Each ``fully_shard``-ed module with the parameters it manages itself (its own minus
    those of nested FSDP modules), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    out = []
    for unit in units:
        nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                  for p in m.parameters()}
        out.append((unit, [p for p in unit.parameters() if id(p) not in nested]))
    return out


class FsdpTransport(LocalTransport):
    """The engine's buckets over an FSDP2-sharded model (see the module docstring).

    The single-process transport over this rank's local shards: its lanes, D2H and H2D tasks
    and bucket lookup are ``LocalTransport``'s; its buffers' ``params`` are the local shards
    (views into FSDP2's shard storage). What differs: the gradients are read from the
    DTensor parameters, validation is all-reduced, and FSDP2's all-gathers wait for the
    publishes."""

    name = "fsdp"
    ordered_launch = False
    """No collective per bucket: FSDP2 issued the reduce-scatters already."""
    grad_divisor = 1
    """FSDP2 averages the gradients over the ranks in its reduce-scatter."""

    def __init__(self, *, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FsdpTransport: initialise torch.distributed first "
                               "(superoffload.distributed.init_distributed under torchrun)")
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank()
        self.world_size = len(self.ranks)
        self.local_ranks = self.world_size  # the prototype runs on one host
        self._published: dict[int, Future[Any]] = {}
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ set-up
    def start(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        if ctx.fingerprint is not None:
            self.agree(ctx.fingerprint)
        st = ctx.state
        plain = [st.names[i] for i in st.trainable if not is_dtensor(st.params[i])]
        if plain:
            raise ValueError(f"FsdpTransport: parameters {plain[:3]} are not FSDP2 shards; "
                             "call fully_shard on the model (and its blocks) before building "
                             "the engine")
        super().start(ctx)  # the d2h and h2d lanes

    def build(self, plan: BucketPlan, states: Mapping[int, ParamState], cast: CastPolicy,
              flow: bool, snapshot: bool,
              moments: torch.dtype = torch.float32) -> list[BucketBuffers]:
        st, be = self.ctx.state, self.ctx.backend
        if flow:
            raise ValueError("FsdpTransport (prototype): weights='flow' is not supported; FSDP2 "
                             "owns where the weights live: use OffloadConfig(weights="
                             "'stationary')")
        if any(b.on_device for b in plan.buckets):
            raise ValueError("FsdpTransport (prototype): GPU tail buckets are not supported; "
                             "use OffloadConfig(ratio=1.0)")
        if snapshot:
            raise ValueError("FsdpTransport (prototype): use OffloadConfig(rollback='inverse')")
        self.buffers, self._pos = [], {}
        for bucket in plan.buckets:
            params = [st.params[i] for i in bucket.param_indices]
            local = [typed(torch.nn.Parameter, local_shard(p)) for p in params]
            local_states = [_local_state(states[i], p)
                            for i, p in zip(bucket.param_indices, params)]
            shard = Bucket(bucket.id, bucket.param_indices, sum(t.numel() for t in local),
                           on_device=False)
            self.buffers.append(build_buffers(
                shard, local, local_states, alloc_host=be.alloc_host,
                alloc_device=be.alloc_device, grad_host_dtype=cast.grad_host_dtype,
                lp_host=cast.low_precision and cast.param_on_host, moment_dtype=moments))
            self._pos.update((i, k) for k, i in enumerate(bucket.param_indices))
        with torch.no_grad():  # a load: the shards take the masters' values
            for buf in self.buffers:
                for shard_t, master in zip(buf.params, buf.master):
                    shard_t.copy_(master)
        self._install_wait_hooks()
        return self.buffers

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _install_wait_hooks(self) -> None:
        """Before FSDP2 all-gathers a unit, its buckets' last publish must have landed."""
        self._remove_hooks()
        st = self.ctx.state
        for unit, params in fsdp_units(st.model):
            buckets = tuple(sorted({st.bucket_of[st.index[id(p)]] for p in params
                                    if id(p) in st.index and st.index[id(p)] in st.bucket_of}))
            if buckets:
                self._hooks.append(unit.register_forward_pre_hook(
                    self._wait_hook(buckets), prepend=True))

    def _wait_hook(self, buckets: tuple[int, ...]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for b in buckets:
                fut = self._published.get(b)
                if fut is not None:
                    wait_for(fut, self.ctx.watchdog_s(), f"publish of bucket {b}")
        return hook

    # ------------------------------------------------------------------ per iteration
    def launch(self, b: int, present: tuple[int, ...], iteration: int,
               streamed: frozenset[int]) -> Future[Any] | None:
        """``LocalTransport.launch`` with the gradients' local shards: FSDP2 writes each
        DTensor parameter's ``.grad``, not its local shard's."""
        if not present:
            return None
        buf, ctx = self.buffers[b], self.ctx
        params = ctx.state.params
        return self._lanes[0].submit(D2HTask(
            bucket=b, iteration=iteration,
            grads=tuple(local_shard(params[i].grad) for i in present),  # type: ignore[arg-type]
            grad_host=tuple(buf.grad_host[self._pos[i]] for i in present),
            ready=ctx.backend.ready_token(), backend=ctx.backend, recorder=ctx.recorder))

    def reduce_stats(self, local: GradStats, present: frozenset[int],
                     checks: Checks = NO_CHECKS) -> GlobalStats:
        """One all-reduce of ZeroTransport's validation vector (runtime/transport.py: the
        shards are disjoint, so the sum of squares is exact)."""
        return all_reduce_validation(local, present, checks, self.ctx.state.trainable,
                                     self.group, self.world_size, torch.device("cpu"),
                                     "all_reduce (validation, FSDP2 transport)")

    def agree(self, fingerprint: Mapping[str, Any]) -> None:
        """Every rank built the same model, configuration and param groups (or all raise)."""
        agree_fingerprint(fingerprint, self.group, self.ranks)

    def adopt(self, indices: Sequence[int]) -> None:
        """Parameters written outside the engine: their local shards become the masters."""
        for i in indices:
            buf, k = self._where(i)
            adopt_value(buf.master[k], buf.params[k],
                        None if buf.lp_host is None else buf.lp_host[k])

    def restore(self, indices: Sequence[int]) -> list[int]:
        """Write the engine's weights back over the local shards ``indices``."""
        with torch.no_grad():
            for i in indices:
                buf, k = self._where(i)
                src = buf.lp_host if buf.lp_host is not None else buf.master
                buf.params[k].copy_(src[k])
        self.ctx.backend.synchronize()
        return []

    def publish(self, b: int, positions: tuple[int, ...], after: Future[Any],
                iteration: int, streamed: frozenset[int], priority: Priority) -> Published:
        published = super().publish(b, positions, after, iteration, streamed, priority)
        if published.device is not None:  # what the unit's all-gather waits for
            self._published[b] = published.device
        return published

    def stall_hint(self) -> str:
        return (f"{super().stall_hint()}; FSDP2's own collectives run in backward and in its "
                "forward pre-hooks")

    def export_states(self) -> dict[int, ParamState]:
        """Full (gathered) state of every trainable parameter. Collective."""
        from torch.distributed.tensor import DTensor

        st = self.ctx.state
        out: dict[int, ParamState] = {}
        for buf in self.buffers:
            for k, i in enumerate(buf.bucket.param_indices):
                p = st.params[i]

                def full(t: torch.Tensor, p: Any = p) -> torch.Tensor:
                    return DTensor.from_local(
                        t.detach().float().clone(), p.device_mesh, p.placements,
                        run_check=False, shape=p.shape, stride=p.stride()).full_tensor()

                out[i] = ParamState(full(buf.master[k]), full(buf.exp_avg[k]),
                                    full(buf.exp_avg_sq[k]), st.steps[i])
        return out

    def close(self) -> None:
        self._remove_hooks()
        super().close()


def _local_state(state: ParamState, p: torch.Tensor) -> ParamState:
    """This rank's shard of a parameter's state (DTensor, or a full tensor from a load)."""
    master, exp_avg, exp_avg_sq = (local_shard(state_like(t, p, torch.float32))
                                   for t in (state.master, state.exp_avg, state.exp_avg_sq))
    return ParamState(master, exp_avg, exp_avg_sq, state.step)
