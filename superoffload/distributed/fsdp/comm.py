"""FSDP2's collectives with our failure messages (docs/distributed.md, "Failures").

FSDP2 all-gathers and reduce-scatters inside the user's ``model(x)`` and ``backward``; a dead
or stalled peer makes the backend raise there with its bare text. ``FSDPModule.
set_custom_all_gather`` / ``set_custom_reduce_scatter`` take FSDP2's ``AllGather`` /
``ReduceScatter`` interface (``allocate`` and ``__call__``): these run the same call under
``collective_guard``, so a survivor raises ``DistributedError`` naming the rank, collective,
peers, timeout and which local peer exited or stopped. An asynchronous call returns the
backend's handle unguarded (FSDP2 waits on it); HSDP's all-reduce is FSDP2's own call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.process_group import collective_guard

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Alloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GuardedAllGather(_Alloc):
    """FSDP2's all-gather of a unit's shards, failing with ``DistributedError``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        if async_op:
            return _all_gather(output_tensor, input_tensor, group=group, async_op=True)
        with collective_guard("all_gather (FSDP2 unit weights)", group):
            return _all_gather(output_tensor, input_tensor, group=group)


class GuardedReduceScatter(_Alloc):
    """FSDP2's reduce-scatter of a unit's gradients, failing with ``DistributedError``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Any:
        if async_op:
            return _reduce_scatter(output_tensor, input_tensor, group=group, op=op,
                                   async_op=True)
        with collective_guard("reduce_scatter (FSDP2 unit gradients)", group):
            return _reduce_scatter(output_tensor, input_tensor, group=group, op=op)


def guard_collectives(units: Sequence[Any]) -> None:
    """Give every unit the guarded collectives (replacing FSDP2's defaults)."""
    for unit in units:
        unit.set_custom_all_gather(GuardedAllGather())
        unit.set_custom_reduce_scatter(GuardedReduceScatter())
