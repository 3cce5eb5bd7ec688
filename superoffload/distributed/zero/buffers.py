"""Buffers of one rank's shard of one offloaded bucket (ZeRO partitioning, zero_layout.py).

Host side (pinned on CUDA), ``shard_numel`` elements each: fp32 master, both moments, the
gradient shard the CPU step reads, and for a bf16/fp16 model the low-precision weight shard
the kernel writes in its pass (host-side casting, paper §4.4) and the all-gather sends.
Device side: the bucket's padded fp32 gradient buffer (reduce-scatter input), the received
gradient shard, and the padded weight buffer the all-gather fills.

The per-segment views are wrapped in the engine's ``BucketBuffers`` so the single-process
step and rollback tasks (runtime/steps.py: speculative step, inverse or snapshot rollback,
replay) run on a shard unchanged. NOTE: for this shard ``BucketBuffers.params`` holds the
segment views of the master, not model parameters: host-bucket tasks read only their shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from superoffload.distributed.zero.layout import ShardLayout
from superoffload.plan.buckets import Bucket
from superoffload.runtime.backend import Backend
from superoffload.runtime.state import BucketBuffers, ParamState


@dataclass(slots=True)
class ShardBucket:
    bucket: Bucket
    """The model bucket (all its parameters)."""
    layout: ShardLayout
    params: list[torch.nn.Parameter]
    """The bucket's model parameters, in bucket order."""
    state: BucketBuffers
    """This rank's segments: master / moments / gradient / low-precision views."""
    master_host: torch.Tensor
    grad_host: torch.Tensor
    """Host, fp32, ``shard_numel``: the reduced gradient shard the CPU step reads."""
    lp_host: torch.Tensor | None
    grad_flat: torch.Tensor
    """Device, fp32, ``padded_numel``: the flattened local gradient (reduce input)."""
    grad_shard: torch.Tensor
    """Device, fp32, ``shard_numel``: this rank's slice of the reduced gradient."""
    weight_flat: torch.Tensor
    """Device, model dtype, ``padded_numel``: the all-gathered weights."""
    weight_views: tuple[torch.Tensor, ...]
    weight_shard_device: torch.Tensor
    flats: list[torch.Tensor]

    @property
    def publish_host(self) -> torch.Tensor:
        """The shard the all-gather sends: the kernel's low-precision copy, or the master."""
        return self.lp_host if self.lp_host is not None else self.master_host

    def segment_param_indices(self) -> list[int]:
        return [self.bucket.param_indices[s.pos] for s in self.layout.segments]


def _flat_views(flat: torch.Tensor, layout: ShardLayout,
                shapes: Sequence[torch.Size]) -> tuple[torch.Tensor, ...]:
    return tuple(flat[off:off + n].view(shape)
                 for off, n, shape in zip(layout.param_offsets, layout.param_numels, shapes))


def build_shard_bucket(bucket: Bucket, params: Sequence[torch.nn.Parameter],
                       states: Sequence[ParamState], layout: ShardLayout, *, backend: Backend,
                       model_dtype: torch.dtype, reduce_mode: str,
                       moment_dtype: torch.dtype = torch.float32) -> ShardBucket:
    """Allocate the shard's buffers and fill them from full per-parameter ``states``."""
    n = layout.shard_numel
    master = backend.alloc_host(n, torch.float32)
    m, v = (backend.alloc_host(n, moment_dtype) for _ in range(2))
    grad_host = backend.alloc_host(n, torch.float32)
    flats = [master, m, v, grad_host]
    for t in flats:
        t.zero_()  # the padding stays zero for ever
    lp: torch.Tensor | None = None
    if model_dtype != torch.float32:
        lp = backend.alloc_host(n, model_dtype)
        flats.append(lp)
    segs = layout.segments

    def seg_views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.shard_offset:s.shard_offset + s.numel] for s in segs]

    with torch.no_grad():
        for s, mv, mm, vv in zip(segs, seg_views(master), seg_views(m), seg_views(v)):
            st = states[s.pos]
            lo, hi = s.param_offset, s.param_offset + s.numel
            mv.copy_(st.master.reshape(-1)[lo:hi])
            mm.copy_(st.exp_avg.reshape(-1)[lo:hi])
            vv.copy_(st.exp_avg_sq.reshape(-1)[lo:hi])
        if lp is not None:
            lp.copy_(master)
    shard_bucket = Bucket(bucket.id, tuple(bucket.param_indices[s.pos] for s in segs),
                          layout.owned_numel, on_device=False)
    master_views = seg_views(master)
    state = BucketBuffers(
        shard_bucket, cast(list[torch.nn.Parameter], list(master_views)), master_views,
        seg_views(m), seg_views(v), grad_host=seg_views(grad_host),
        lp_host=None if lp is None else seg_views(lp), flat=list(flats))
    grad_flat = backend.alloc_device(layout.padded_numel, torch.float32)
    grad_flat.zero_()
    start = layout.shard_start
    if reduce_mode == "all_reduce":
        grad_shard = grad_flat[start:start + n]
    else:
        grad_shard = backend.alloc_device(n, torch.float32)
    weight_flat = backend.alloc_device(layout.padded_numel, model_dtype)
    shapes = [st.master.shape for st in states]  # a weight-flow parameter may be released
    on_cpu = weight_flat.device.type == "cpu"
    shard_dev = (lp if lp is not None else master) if on_cpu else backend.alloc_device(n, model_dtype)
    return ShardBucket(bucket, layout, list(params), state, master, grad_host, lp, grad_flat, grad_shard,
                       weight_flat, _flat_views(weight_flat, layout, shapes), shard_dev,
                       flats + [grad_flat, weight_flat])


def fill_grad_flat(sb: ShardBucket) -> None:
    """Flatten the bucket's local gradients into the reduce buffer (fp32; a parameter with no
    gradient on this rank contributes zeros: the sum over ranks still needs its slot)."""
    lay = sb.layout
    with torch.no_grad():
        for off, n, p in zip(lay.param_offsets, lay.param_numels, sb.params):
            view = sb.grad_flat[off:off + n]  # flat: a weight-flow parameter may be released
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))


def export_segments(sb: ShardBucket) -> list[tuple[int, int, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]]:
    """(param index, param offset, master, exp_avg, exp_avg_sq) CPU copies of each segment."""
    st, out = sb.state, []
    for k, s in enumerate(sb.layout.segments):
        out.append((sb.bucket.param_indices[s.pos], s.param_offset,
                    st.master[k].detach().to("cpu", copy=True),
                    st.exp_avg[k].detach().to("cpu", torch.float32, copy=True),
                    st.exp_avg_sq[k].detach().to("cpu", torch.float32, copy=True)))
    return out
