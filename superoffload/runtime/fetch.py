"""What weight-flow streams, and the task that fetches one block (paper §4.5).

``find_blocks``/``streamed_params`` pick the streamed parameters; ``FetchTask`` is the frozen
task the ``fetch`` lane runs (runtime/lanes.py): wait for the CPU step that last wrote the
block's host copies, then one H2D copy of the block from the homes in host memory and, for
homes in the storage tier's file, a read of the version in force into pinned staging buffers
and a copy from there (runtime/home_reads.py), recorded as a ``weight_fetch`` span on the h2d
lane (the reads also as ``tier_read`` spans on the storage lane). The schedule that submits
them is runtime/weightflow.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.home_reads import HomeSpan, copy_spans
from superoffload.runtime.tier import StateTier
from superoffload.runtime.transfers import tensors_nbytes, wait_for
from superoffload.telemetry.events import KIND_WEIGHT_FETCH, LANE_H2D
from superoffload.telemetry.recorder import Recorder


class WeightFlowError(RuntimeError):
    """The weight-flow schedule broke an invariant (a bug, or a model it cannot stream)."""


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The streamed blocks: the longest ``nn.ModuleList`` (as ModelShape.from_module)."""
    lists: list[torch.nn.ModuleList] = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            "OffloadConfig.weights='flow' streams the blocks of the model's longest nn.ModuleList, "
            "and this model has none; use weights='stationary'"
        )
    sizes = [len(m) for m in lists]
    # the first of the longest, as from_module
    return list(lists[sizes.index(max(sizes))])


def streamed_params(model: torch.nn.Module, blocks: Sequence[torch.nn.Module],
                    streamable: set[int]) -> list[list[torch.nn.Parameter]]:
    """Per block, the parameters that stream: owned only inside that one block and in
    ``streamable`` (trainable, planned). Shared or tied weights stay resident."""
    owner: dict[int, set[int]] = {}
    inside: set[int] = set()
    for k, block in enumerate(blocks):
        for m in block.modules():
            inside.add(id(m))
            for p in m.parameters(recurse=False):
                owner.setdefault(id(p), set()).add(k)
    outside: set[int] = set()
    for m in model.modules():
        if id(m) not in inside:
            outside.update(id(p) for p in m.parameters(recurse=False))
    out: list[list[torch.nn.Parameter]] = []
    for k, block in enumerate(blocks):
        ps = [p for p in block.parameters()
              if id(p) in streamable and owner[id(p)] == {k} and id(p) not in outside]
        out.append(ps)
    return out


@dataclass(frozen=True, slots=True)
class FetchTask:
    """Copy one block's home copies into its fresh device buffer: one H2D from the homes in
    host memory, then the spans of the homes in the file (``stored``) through the tier's
    staging buffers."""

    block: int
    iteration: int
    src_host: tuple[torch.Tensor, ...]
    dst_device: tuple[torch.Tensor, ...]
    after: tuple[Future[Any], ...]
    """The last CPU step / rollback / replay of each bucket holding the block's weights."""
    ready: Any
    """Compute-stream token recorded when the buffer was allocated (CUDA event, or None)."""
    device_ops: DeviceOps
    recorder: Recorder
    watchdog_s: float
    stored: tuple[HomeSpan, ...] = ()
    """The parts of the block whose homes are in the storage tier's file (``tier``'s)."""
    tier: StateTier | None = None

    @property
    def nbytes(self) -> int:
        """The block's bytes (from memory and from the file)."""
        return tensors_nbytes(self.dst_device) + sum(
            v.numel() * v.element_size() for s in self.stored for _, v in s.parts)

    def run(self) -> Any:
        for fut in self.after:
            wait_for(fut, self.watchdog_s, f"CPU step before the fetch of block {self.block}")
        with self.recorder.device_span(LANE_H2D, KIND_WEIGHT_FETCH,
                                       stream=self.device_ops.stream("h2d"),
                                       iteration=self.iteration,
                                       nbytes=self.nbytes):
            stream = getattr(self.device_ops, "h2d_stream", None)
            if stream is not None and self.ready is not None:
                # the buffer may reuse memory the compute stream still reads: order after it
                stream.wait_event(self.ready)
            token = self.device_ops.h2d(self.src_host, self.dst_device)
            # the same H2D stream: the last copy's token covers the first
            if self.stored:
                assert self.tier is not None
                token = copy_spans(self.tier, self.stored, self.device_ops, self.recorder,
                                   iteration=self.iteration)
            return token
