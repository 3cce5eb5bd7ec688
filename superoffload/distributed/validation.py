"""The collectives every data-parallel engine runs besides its data: the ranks agree on what
they build, and sum one validation vector per iteration (runtime/transport.py packs it).

* ``agree_fingerprint``: every rank compares the engine's fingerprint (parameters, resolved
  configuration, param groups: runtime/contract.py) once, before any collective whose sizes
  depend on it, and all raise the same ``RanksDisagree`` naming the first field that
  differs, instead of training apart silently or hanging in a mismatched collective;
* ``all_reduce_validation``: the local statistics, the contract's checks and which
  parameters got a gradient, summed over the ranks in one all-reduce (fp64; on NCCL a device
  tensor) -- the global norm, overflow and verdict every rank then shares (paper §4.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from superoffload.distributed.process_group import collective_guard
from superoffload.runtime.contract import RanksDisagree, first_difference
from superoffload.runtime.devices import GradStats
from superoffload.runtime.transport import (
    Checks,
    GlobalStats,
    validation_result,
    validation_vector,
)


def group_device(group: Any) -> torch.device:
    """Where a collective's tensors must live for ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_validation(local: GradStats, present: frozenset[int], checks: Checks,
                          trainable: Sequence[int], group: Any, world_size: int,
                          label: str) -> GlobalStats:
    """One all-reduce (SUM) of every rank's ``validation_vector``: the iteration's global
    statistics."""
    totals = torch.tensor(validation_vector(local, present, checks, trainable),
                          dtype=torch.float64, device=group_device(group))
    with collective_guard(label, group):
        dist.all_reduce(totals, group=group)
    return validation_result(totals.cpu().tolist(), trainable, world_size)


def agree_fingerprint(fingerprint: Mapping[str, Any], group: Any, ranks: list[int]) -> None:
    """All ``ranks`` of ``group`` compare ``fingerprint`` (all_gather_object: sizes may
    differ) and raise the same ``RanksDisagree`` naming the first field that differs."""
    prints: list[Any] = [None] * len(ranks)
    with collective_guard("all_gather_object (rank agreement)", group):
        dist.all_gather_object(prints, dict(fingerprint), group=group)
    diff = first_difference(prints, ranks)
    if diff is not None:
        raise RanksDisagree(
            f"data-parallel ranks disagree: {diff}. Every rank must build the same model "
            "(names, shapes, dtypes, requires_grad), the same OffloadConfig (placement and "
            "thread fields may differ) and the same param groups; fix the launch script so "
            "all ranks run the same configuration")
