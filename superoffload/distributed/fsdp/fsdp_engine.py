"""Data parallel: the offload engine over PyTorch's FSDP2 (paper §4.6; docs/distributed.md).

``FsdpOffloadEngine`` is ``OffloadEngine`` (runtime/engine.py) built with ``FsdpTransport``:
the same iteration core; FSDP2 reduce-scatters the gradients and all-gathers the weights,
each rank keeps and steps the fp32 masters and moments of its own shards. Build it on every
rank after ``init_distributed()`` (``so.initialize`` does under torchrun); a model not
sharded yet is sharded here over the job's mesh (units.py, mesh.py). FSDP2 stays at this
edge, as torchtitan applies it to the model outside its training step: this module shards
the model, sets up its units (``prepare_units``) and puts the hooks that order FSDP2's
collectives with the engine on them (hooks.py); the step's code is the single-process one,
over the transport. Besides the transport:
DCP checkpoints (checkpoint.py); ``master_weights()`` gathers (collective) and
``state_dict()`` holds DTensors, as torch optimizers over FSDP2 do; ``reconfigure()`` is
collective and cannot switch the weight policy (FSDP2 places a unit's shards when it shards
it); ``weights="auto"`` runs weight-stationary (every rank must choose alike).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from superoffload.config import RECONFIGURABLE, ConfigError, OffloadConfig
from superoffload.distributed.budget import HostBudget
from superoffload.distributed.fsdp import checkpoint
from superoffload.distributed.fsdp.comm import guard_collectives
from superoffload.distributed.fsdp.flow import FsdpFlow, check_flow_units
from superoffload.distributed.fsdp.fsdp_transport import FsdpTransport, full_cpu
from superoffload.distributed.fsdp.hooks import UnitHooks
from superoffload.distributed.fsdp.units import (
    Unit,
    block_modules,
    fsdp_units,
    is_sharded,
    shard_model,
)
from superoffload.distributed.validation import agree_fingerprint
from superoffload.kernels.hyper import hypers_of
from superoffload.plan.schedule import ScheduleFacts
from superoffload.runtime import contract
from superoffload.runtime.engine import OffloadEngine
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.optim_view import param_groups_from
from superoffload.telemetry.recorder import Recorder


def job_mesh() -> Any:
    """The mesh ``init_distributed`` built (mesh.py), else a 1-D mesh over every rank."""
    from superoffload.distributed import process_group

    try:
        return process_group.get_groups().mesh.fsdp
    except RuntimeError:  # torch.distributed started by someone else
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))


def agree_before_sharding(model: torch.nn.Module, optimizer: Any, config: OffloadConfig) -> None:
    """Every rank built the same model, configuration and param groups (runtime/contract.py's
    fingerprint), or all raise ``RanksDisagree``: checked before rank 0's weights are
    broadcast, which with another model's shapes would fail inside the backend."""
    groups = param_groups_from(model, optimizer)
    state = EngineState.from_model(model, groups)
    group = dist.group.WORLD
    agree_fingerprint(contract.fingerprint(state, config, hypers_of(groups)), group,
                      dist.get_process_group_ranks(group))


def prepare_units(model: torch.nn.Module, *, flow: bool) -> list[Unit]:
    """The sharded model's FSDP2 units (root first), set up for the engine: each reduces zeros
    for a parameter this rank did not use (ranks may use different parameters: DDP's
    semantics; hooks.py records which), its collectives raise ``DistributedError`` naming a
    dead or stalled peer (comm.py), and under weight-flow the block units must keep their
    shards on the host, where the CPU step publishes (flow.py)."""
    units = fsdp_units(model)
    for module in (m for u in units for m in u.modules):
        module.set_reduce_scatter_unused_params(True, recurse=False)
    guard_collectives([u.modules[0] for u in units])
    if flow:
        check_flow_units(units, model)
    return units


def remap_groups(optimizer: Any, before: dict[int, str],
                 after: dict[str, torch.nn.Parameter]) -> Any:
    """Param groups naming the model's parameters from before sharding, rewritten to the
    DTensor parameters ``fully_shard`` put in their place (same names)."""
    if optimizer is None or isinstance(optimizer, Mapping):
        # hyper-parameters only: the engine takes the model's parameters
        return optimizer
    out = []
    for g in optimizer:
        params = g.get("params")
        if params is None:
            out.append(g)
            continue
        if isinstance(params, torch.Tensor):
            params = [params]
        out.append({**g, "params": [after[before[id(p)]] if id(p) in before else p
                                    for p in params]})
    return out


class FsdpOffloadEngine(OffloadEngine):
    """Data-parallel offload engine over FSDP2 (see the module docstring). Same training API
    as ``OffloadEngine``; plus ``full_master_weights()`` (collective) and DCP checkpoints.

    ``mesh``: the DeviceMesh to shard over (default: the job's, mesh.py); ``mp_policy``:
    FSDP2's ``MixedPrecisionPolicy`` for a model this engine shards;
    ``host_available_bytes`` / ``host_headroom``: the host memory check's inputs
    (distributed/budget.py). Other keywords go to ``OffloadEngine``."""

    def __init__(self, model: torch.nn.Module,
                 optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                 config: OffloadConfig, telemetry: Recorder | None = None, *,
                 mesh: Any = None, mp_policy: Any = None,
                 host_available_bytes: int | None = None, host_headroom: float | None = None,
                 **kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FsdpOffloadEngine: call superoffload.distributed."
                               "init_distributed() first (under torchrun)")
        config = config.validate()
        auto = config.weights == "auto"
        if auto:
            config = config.replace(weights="stationary")
        if is_sharded(model):
            if mp_policy is not None:
                raise ValueError("FsdpOffloadEngine(mp_policy=...): the model is sharded "
                                 "already; pass the policy to your fully_shard calls")
        else:  # the ranks agree before the broadcast, whose sizes depend on the model
            agree_before_sharding(model, optimizer, config)
            before = {id(p): n for n, p in model.named_parameters()}
            shard_model(model, mesh if mesh is not None else job_mesh(),
                        bucket_bytes=config.bucket_bytes,
                        blocks_on_host=config.weights == "flow", mp_policy=mp_policy,
                        group=dist.group.WORLD)
            optimizer = remap_groups(optimizer, before, dict(model.named_parameters()))
        self.units = prepare_units(model, flow=config.weights == "flow")
        self.unit_hooks = UnitHooks(self.units)
        self.fsdp = FsdpTransport(used=self.unit_hooks.usage.used, mesh=mesh,
                                  host_available_bytes=host_available_bytes,
                                  host_headroom=host_headroom)
        self._thread = threading.get_ident()
        super().__init__(model, optimizer, config, telemetry, transport=self.fsdp, **kwargs)
        self.unit_hooks.install(self.state.index, self.fsdp, self.grad_sync)
        # removed with the engine's own (runtime/lifetime.py)
        self.hooks.append(self.unit_hooks)
        if auto:
            self.telemetry.note(0, "weights='auto' runs weight-stationary under data parallel "
                                   "(every rank must choose alike)")

    # ------------------------------------------------------------------ views
    @property
    def rank(self) -> int:
        return self.fsdp.rank

    @property
    def world_size(self) -> int:
        return self.fsdp.world_size

    @property
    def local_world_size(self) -> int:
        return self.fsdp.local_ranks

    @property
    def host_budget(self) -> HostBudget | None:
        return self.fsdp.host_budget

    @property
    def reconfigurable(self) -> frozenset[str]:
        return RECONFIGURABLE - {"weights"}

    # ------------------------------------------------------------------ the engine's parts
    def facts(self) -> ScheduleFacts:
        # the ranks the offloaded state is split over (the planner's dp; HSDP: one replica's),
        # though FSDP2 averages the gradients itself
        return dataclasses.replace(super().facts(), dp=self.fsdp.shard_ranks)

    def new_flow(self, depth: int) -> FsdpFlow:  # type: ignore[override]
        blocks = {id(b) for b in block_modules(self.model)}
        units = [m for u in self.units for m in u.modules if id(m) in blocks]
        return FsdpFlow(units, self.unit_hooks, depth)

    def grad_sync(self) -> bool:
        """Root forward: does this micro-step's backward reduce-scatter (hooks.py)?"""
        micro = self.launcher.current.micro_step
        # a new optimizer step: forget which parameters were used
        if micro == 0:
            self.unit_hooks.usage.used.clear()
        return micro + 1 >= self.config.grad_accum_steps or self.accum_on_host

    def reconfigure(self, **changes: Any) -> None:
        """Collective: call it on every rank, from the training thread, between iterations;
        the ranks agree on ``changes`` before they are queued (applied at the next iteration
        on every rank, as one process applies them)."""
        if threading.get_ident() != self._thread:
            raise ConfigError("reconfigure() under data parallel is a collective: call it on "
                              "every rank from the training thread (the one that built the "
                              "engine), between iterations")
        self.fsdp.agree({"reconfigure": sorted((k, repr(v)) for k, v in changes.items())})
        super().reconfigure(**changes)

    # ------------------------------------------------------------------ state
    def master_weights(self) -> dict[str, torch.Tensor]:
        """Full fp32 master of every trainable parameter (CPU). Collective."""
        self.settled("master_weights()")
        self.synchronize()
        return {self.state.names[i]: full_cpu(s.master) for i, s in self.export_states().items()}

    def full_master_weights(self) -> dict[str, torch.Tensor]:
        """``master_weights()``: the name the former ZeRO engine used."""
        return self.master_weights()

    def save_checkpoint(self, path: str, extra: Any = None, *, lr_scheduler: Any = None) -> str:
        """DCP checkpoint (checkpoint.py): every rank writes its shards. Collective."""
        self.settled("save_checkpoint()")
        return checkpoint.save_sharded(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        """Load a checkpoint written by any world size (DCP reshards; a former ZeRO
        checkpoint is converted). Collective; returns ``extra``."""
        self.settled("load_checkpoint()")
        return checkpoint.load_sharded(self, path, lr_scheduler=lr_scheduler)
