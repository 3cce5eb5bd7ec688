"""Weight-flow over FSDP2 (paper §4.5; docs/distributed.md, "Data parallel over FSDP2").

A block unit with ``CPUOffloadPolicy`` keeps its shards on the host -- where the engine's CPU
step publishes -- all-gathers them at the unit's forward (and again for backward) and frees
the unsharded weights after it, prefetching the next units (``set_modules_to_forward_prefetch``
= ``prefetch_depth``): single-process weight-flow's schedule (runtime/weightflow.py) at unit
granularity. ``FsdpFlow`` stands in for ``WeightFlow`` in runtime/weight_policy.py: it sets the
prefetch, counts each block's materializations (``stats.fetches``) and streams nothing itself.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from superoffload.distributed.fsdp.units import Unit, block_modules, shards_on_host
from superoffload.runtime.hook_base import PicklableHook, eager
from superoffload.runtime.weightflow import FlowStats


def check_flow_units(units: Sequence[Unit], model: torch.nn.Module) -> None:
    """Weight-flow on a GPU: FSDP2 must keep the block units' shards on the host."""
    blocks = {id(b) for b in block_modules(model)}
    device = [type(m).__name__ for u in units for m in u.modules
              if id(m) in blocks and not shards_on_host(u.params)]
    if device:
        raise ValueError(
            "OffloadConfig.weights='flow' over FSDP2: the block units keep their shards on the "
            f"device ({device[0]}); shard them with fully_shard(block, offload_policy="
            "CPUOffloadPolicy()), or let FsdpOffloadEngine shard the model")


class _Count(PicklableHook):
    """After FSDP2's pre-hook: the block is resident (unsharded) for this forward."""

    def __init__(self, flow: FsdpFlow) -> None:
        self.flow = weakref.ref(flow)

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        flow = self.flow()
        if flow is not None:
            flow.stats.fetches += 1


class FsdpFlow:
    """The engine's weight-flow object under the FSDP2 transport (see the module docstring).
    ``blocks``: the block units, forward order; ``hooks``: sets FSDP2's prefetch and the
    publish waits that follow it (hooks.py ``UnitHooks``)."""

    streamed_indices: frozenset[int] = frozenset()
    held_bytes = 0
    iteration_peak_bytes = 0

    def __init__(self, blocks: Sequence[Any], hooks: Any, depth: int) -> None:
        self.blocks = list(blocks)
        self.hooks = hooks
        self.depth = depth
        self.params = [list(b.parameters()) for b in self.blocks]
        self.stats = FlowStats()
        self.handles: list[Any] = []

    def attach(self) -> None:
        self.hooks.set_prefetch(self.blocks, self.depth)
        self.handles = [b.register_forward_pre_hook(_Count(self)) for b in self.blocks]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        # the engine may be closed already
        with contextlib.suppress(Exception):
            self.hooks.set_prefetch(self.blocks, 0)

    # what runtime/weight_policy.py calls of a WeightFlow: FSDP2 does it already
    def begin_forward(self) -> None:
        return None

    def end_backward(self) -> None:
        return None

    def materialize(self) -> None:
        return None

    def release_all(self) -> None:
        return None

    def restore_in_place(self) -> None:
        self.detach()
