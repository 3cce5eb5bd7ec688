"""Collective set-up steps of ZeroOffloadEngine, run once on every rank before allocation.

* ``broadcast_model``: every rank starts from the first rank's weights and buffers (as
  DDP does), so differently seeded ranks still train one model;
* ``count_local_ranks``: how many ranks share this host (torchrun's LOCAL_WORLD_SIZE, else
  a gather of host names), which splits the cores and the host memory (zero_budget.py);
* ``agree_host_budget``: every rank checks its host budget and the group takes the
  maximum of the failure flags, so either all ranks allocate or all raise
  HostMemoryError, and no rank is left waiting in a collective for a peer that gave up.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.launch import collective_guard
from superoffload.distributed.zero.budget import HostBudget, HostMemoryError, budget_message


def broadcast_model(model: torch.nn.Module, group: Any, src: int) -> None:
    """Copy global rank ``src``'s parameters and buffers to every rank of ``group``."""
    with torch.no_grad(), collective_guard("broadcast (model)", group):
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def count_local_ranks(group: Any) -> int:
    """Ranks of ``group`` on this host (torchrun's LOCAL_WORLD_SIZE when set)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    hosts: list[object] = [None] * dist.get_world_size(group)
    with collective_guard("all_gather_object (host names)", group):
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return max(1, hosts.count(socket.gethostname()))


def agree_host_budget(budget: HostBudget, group: Any, device: torch.device, rank: int) -> None:
    """Raise HostMemoryError on every rank when any rank's host budget does not fit."""
    bad = torch.tensor([0.0 if budget.fits else 1.0], device=device)
    with collective_guard("all_reduce (host budget)", group):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item() > 0:
        where = "this host" if not budget.fits else "another rank's host"
        raise HostMemoryError(f"rank {rank}: {budget_message(budget, where)}")
