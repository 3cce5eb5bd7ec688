"""Weight-flow under ZeRO data parallel (paper §4.5 with §4.6; docs/distributed.md).

Single process, a block's *home* is the host copy its CPU step writes (runtime/weightflow.py).
Under ZeRO a rank steps only its 1/N shard of each bucket, so no rank has the whole updated
bucket on its host until the all-gather: here the home of every streamed parameter is its
slice of a per-bucket *gathered* host buffer, and

* the all-gather of a bucket (zero_comm.GatherTask) publishes the updated weights into the
  homes instead of the (released) device parameters; parameters that stay resident
  (embeddings, head, norms outside the blocks) are still written in place;
* a block's fetch waits for the last all-gather of every bucket holding its weights
  (``engine._home_ready``), exactly as the single-process fetch waits for the CPU step;
* gradients still reduce-scatter per bucket as they become final; a streamed parameter's
  device gradient is freed once it is flattened into the bucket's reduce buffer.

On the CPU backend the gathered buffer *is* the bucket's all-gather output (no extra copy).
On CUDA it is a separate host buffer (pinned when the backend pins): the all-gather runs on
the device (NCCL needs device tensors), its result is copied down to the home and the gather
lane waits for that copy before the fetch may read it -- one extra D2H of the bucket per
step that a host-side all-gather would save (a caveat, docs/distributed.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from superoffload.distributed.zero_buffers import ShardBucket
from superoffload.runtime.weightflow import WeightFlow

if TYPE_CHECKING:
    from superoffload.distributed.zero import ZeroOffloadEngine
    from superoffload.runtime.backend import Backend


class ZeroWeightFlow(WeightFlow):
    """WeightFlow whose homes are the all-gathered host buffers of ZeroOffloadEngine."""

    def __init__(self, engine: ZeroOffloadEngine, depth: int, lane: Any) -> None:
        # WeightFlow reads only attributes both engines share (model, _params, _trainable,
        # _index, _bucket_of membership, model_dtype, backend, telemetry, iteration, config,
        # _home_ready, _wait); the two lookups that differ are overridden below.
        super().__init__(cast(Any, engine), depth, lane)
        self.zero = engine

    def _home(self, index: int) -> torch.Tensor:
        return self.zero._homes[index]

    def _home_buckets(self, k: int) -> list[int]:
        return sorted({self.zero._bucket_of[i] for i in self.indices[k]})


def alloc_homes(sb: ShardBucket, backend: Backend) -> tuple[torch.Tensor, ...]:
    """Per parameter of the bucket, its home view: the all-gather output itself on the CPU
    backend, else a slice of a host buffer the gathered weights are copied down to."""
    if sb.weight_flat.device.type == "cpu":
        return sb.weight_views
    flat = backend.alloc_host(sb.weight_flat.numel(), sb.weight_flat.dtype)
    sb.flats.append(flat)
    return tuple(flat[v.storage_offset():v.storage_offset() + v.numel()].view(v.shape)
                 for v in sb.weight_views)


def fill_homes(engine: ZeroOffloadEngine, sb: ShardBucket, homes: tuple[torch.Tensor, ...],
               masters: list[torch.Tensor]) -> None:
    """Set the homes to the masters (in the model dtype) and remember them per parameter."""
    with torch.no_grad():
        for i, home, master in zip(sb.bucket.param_indices, homes, masters):
            home.copy_(master.reshape(home.shape))
            engine._homes[i] = home


def gather_targets(engine: ZeroOffloadEngine, sb: ShardBucket
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(gathered views, destinations) of a bucket's all-gather: the home of a streamed
    parameter, ``param.data`` of a resident one; a home that is the gathered view itself
    (CPU backend) needs no copy and is left out."""
    flow = engine.flow
    views: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for view, p, i in zip(sb.weight_views, sb.params, sb.bucket.param_indices):
        target = engine._homes[i] if flow is not None and flow.is_streamed(p) else p.data
        if target.data_ptr() == view.data_ptr() and target.device == view.device:
            continue
        views.append(view)
        dst.append(target)
    return tuple(views), tuple(dst)


def free_streamed_grads(engine: ZeroOffloadEngine, sb: ShardBucket) -> None:
    """The gradients are in the reduce buffer: free the streamed ones' device copies (§4.5)."""
    flow = engine.flow
    if flow is None:
        return
    for p in sb.params:
        if flow.is_streamed(p):
            p.grad = None
