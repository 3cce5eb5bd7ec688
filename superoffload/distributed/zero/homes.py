"""Weight-flow under ZeRO data parallel (paper §4.5 with §4.6; docs/distributed.md).

Single process, a block's *home* is the host copy its CPU step writes (runtime/weightflow.py).
Under ZeRO a rank steps only its 1/N shard of each bucket, so no rank has the whole updated
bucket on its host until the all-gather: here the home of every streamed parameter is its
slice of a per-bucket *gathered* host buffer, and

* the all-gather of a bucket (comm.GatherTask) publishes the updated weights into the
  homes instead of the (released) device parameters; parameters that stay resident
  (embeddings, head, norms outside the blocks) are still written in place;
* a block's fetch waits for the last all-gather of every bucket holding its weights
  (the scheduler's ``home_ready``), exactly as the single-process fetch waits for the CPU
  step (runtime/weightflow.py reads the homes through ``ZeroTransport.home``);
* gradients still reduce-scatter per bucket as they become final; a streamed parameter's
  device gradient is freed once it is flattened into the bucket's reduce buffer.

On the CPU backend the gathered buffer *is* the bucket's all-gather output (no extra copy).
On CUDA it is a separate host buffer (pinned when the backend pins): the all-gather runs on
the device (NCCL needs device tensors), its result is copied down to the home and the gather
lane waits for that copy before the fetch may read it -- one extra D2H of the bucket per
step that a host-side all-gather would save (a caveat, docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from superoffload.distributed.zero.buffers import ShardBucket
from superoffload.runtime.backend import Backend


def alloc_homes(sb: ShardBucket, backend: Backend) -> tuple[torch.Tensor, ...]:
    """Per parameter of the bucket, its home view: the all-gather output itself on the CPU
    backend, else a slice of a host buffer the gathered weights are copied down to."""
    if sb.weight_flat.device.type == "cpu":
        return sb.weight_views
    flat = backend.alloc_host(sb.weight_flat.numel(), sb.weight_flat.dtype)
    sb.flats.append(flat)
    return tuple(flat[v.storage_offset():v.storage_offset() + v.numel()].view(v.shape)
                 for v in sb.weight_views)


def fill_homes(sb: ShardBucket, homes: Sequence[torch.Tensor],
               masters: Sequence[torch.Tensor]) -> None:
    """Set the homes to the masters' values (in the model dtype)."""
    with torch.no_grad():
        for home, master in zip(homes, masters):
            home.copy_(master.reshape(home.shape))


def gather_targets(sb: ShardBucket, homes: Mapping[int, torch.Tensor], streamed: frozenset[int]
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(gathered views, destinations) of a bucket's all-gather: the home of a streamed
    parameter, ``param.data`` of a resident one; a home that is the gathered view itself
    (CPU backend) needs no copy and is left out."""
    views: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for view, p, i in zip(sb.weight_views, sb.params, sb.bucket.param_indices):
        target = homes[i] if i in streamed else p.data
        if target.data_ptr() == view.data_ptr() and target.device == view.device:
            continue
        views.append(view)
        dst.append(target)
    return tuple(views), tuple(dst)
