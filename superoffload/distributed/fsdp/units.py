"""FSDP2 units: which ``fully_shard`` modules a model has, and sharding a plain model into them.

``shard_model`` is what ``FsdpOffloadEngine`` does with a model that is not sharded yet: every
rank starts from the first rank's weights and buffers (as DDP does), then the transformer
blocks (the longest ``nn.ModuleList``, as weight-flow streams them: runtime/fetch.py) become
units and the root takes the rest (embeddings, final norm, head, tied weights), the wrapping
torchtitan uses. Weight-stationary (paper §4.2), consecutive blocks share a unit up to one
bucket, and a unit keeps its unsharded weights from forward through backward
(``reshard_after_forward=False``): one all-gather per unit and iteration. Weight-flow (§4.5):
one unit per block with ``CPUOffloadPolicy`` (flow.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.process_group import collective_guard
from superoffload.plan.fsdp_units import block_units


@dataclass(frozen=True, slots=True)
class Unit:
    """One FSDP2 unit: what one all-gather gathers and one reduce-scatter reduces."""

    modules: tuple[Any, ...]
    """The ``fully_shard`` modules sharing it, forward order (several: grouped
    ``fully_shard([a, b])``)."""
    params: tuple[torch.nn.Parameter, ...]
    """The parameters it shards (not those of nested units)."""


def fsdp_units(model: torch.nn.Module) -> list[Unit]:
    """The model's FSDP2 units, outermost (the root) first: modules that share one FSDP2
    state form one unit."""
    from torch.distributed.fsdp import FSDPModule

    modules: list[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups: dict[int, list[Any]] = {}
    # the one place this package reads FSDP2's state object: its identity
    for m in modules:
        groups.setdefault(id(m._get_fsdp_state()), []).append(m)
    out = []
    for members in groups.values():
        mine = {id(m) for m in members}
        nested = {id(p) for u in members for m in u.modules()
                  if id(m) not in mine and isinstance(m, FSDPModule)
                  for p in m.parameters()}  # type: ignore[attr-defined]
        seen: dict[int, torch.nn.Parameter] = {}
        for u in members:
            seen.update((id(p), p) for p in u.parameters() if id(p) not in nested)
        out.append(Unit(tuple(members), tuple(seen.values())))
    return out


def is_sharded(model: torch.nn.Module) -> bool:
    """The model holds ``fully_shard`` modules (FSDP2) already."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shards_on_host(params: Sequence[torch.nn.Parameter]) -> bool:
    """The shards live in host memory: a CPU mesh, or ``CPUOffloadPolicy`` on a GPU mesh."""
    return all(p.device.type == "cpu" for p in params)


def broadcast_model(model: torch.nn.Module, group: Any, src: int) -> None:
    """Copy global rank ``src``'s parameters and buffers to every rank of ``group``."""
    with torch.no_grad(), collective_guard("broadcast (model)", group):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the longest ``nn.ModuleList`` (none: no block units)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    sizes = [len(m) for m in lists]
    return list(lists[sizes.index(max(sizes))])


def shard_model(model: torch.nn.Module, mesh: Any, *, bucket_bytes: int, blocks_on_host: bool,
                mp_policy: Any = None, group: Any = None) -> None:
    """Broadcast rank 0's weights over ``group``, then ``fully_shard`` the blocks and the root
    over ``mesh`` (see the module docstring). Weight-stationary: consecutive blocks share a
    unit up to one bucket (``bucket_bytes`` of fp32 gradients: FSDP2's per-unit collectives
    cost what a bucket's fixed costs do), and a model that fits one bucket is one unit, the
    root. Weight-flow (``blocks_on_host``): one unit per block, its shards on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # the group's first rank is the source: every rank starts from its weights (as DDP does)
    source = dist.get_process_group_ranks(group)[0] if group else 0
    broadcast_model(model, group, source)
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    blocks = block_modules(model)
    units = block_units([sum(p.numel() for p in b.parameters()) for b in blocks],
                        sum(p.numel() for p in model.parameters()), bucket_bytes=bucket_bytes,
                        weights="flow" if blocks_on_host else "stationary")  # the planner's rule
    if units.on_host:  # weight-flow: gathered for forward, freed, gathered for backward
        host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for (k,) in units.groups:
            fully_shard(blocks[k], mesh=mesh, mp_policy=mp, offload_policy=host)
    else:
        # one all-gather per iteration
        for ks in units.groups:
            members = [blocks[k] for k in ks]
            # a single block is sharded as itself (the module becomes its FSDP unit); a group of
            # blocks as one unit over the list
            unit: Any = members[0]
            if len(members) > 1:
                unit = members
            fully_shard(unit, mesh=mesh, mp_policy=mp,
                        reshard_after_forward=units.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
