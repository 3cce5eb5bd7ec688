"""Putting a rank's shards back together: the full fp32 state of every parameter (collective).

Used where the whole state is needed on every rank: ``master_weights()``, and checkpoints
written by one world size and read by another go through checkpoint.py's consolidation
instead (no communication).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superoffload.distributed.launch import collective_guard
from superoffload.distributed.zero.buffers import ShardBucket
from superoffload.distributed.zero.comm import all_gather_flat
from superoffload.runtime.state import BucketBuffers, ParamState


def all_gather_host(shard: torch.Tensor, padded: int, device: torch.device,
                    group: Any) -> torch.Tensor:
    """All-gather equal host shards over ``group``; returns the padded flat tensor (CPU)."""
    src = shard.to(device)
    out = torch.empty(padded, dtype=shard.dtype, device=device)
    with collective_guard("all_gather (master weights)", group):
        all_gather_flat(out, src, group=group)
    return out.cpu()


def gather_full_states(shards: Mapping[int, ShardBucket], tails: Mapping[int, BucketBuffers],
                       shapes: Sequence[torch.Size], steps: Sequence[int],
                       device: torch.device, group: Any) -> dict[int, ParamState]:
    """Full fp32 state of every trainable parameter on every rank (call synchronized)."""
    out: dict[int, ParamState] = {}
    for b in sorted(set(shards) | set(tails)):
        if b in tails:
            buf = tails[b]
            for pos, i in enumerate(buf.bucket.param_indices):
                out[i] = ParamState(buf.master[pos].detach().to("cpu", torch.float32, copy=True),
                                    buf.exp_avg[pos].detach().cpu().clone(),
                                    buf.exp_avg_sq[pos].detach().cpu().clone(), steps[i])
            continue
        sb = shards[b]
        lay = sb.layout
        fulls = [all_gather_host(t.float(), lay.padded_numel, device, group)  # bf16 moments too
                 for t in sb.state.flat[:3]]
        for pos, i in enumerate(sb.bucket.param_indices):
            lo, hi = lay.param_offsets[pos], lay.param_offsets[pos] + lay.param_numels[pos]
            m, a, s = (f[lo:hi].clone().view(shapes[i]) for f in fulls)  # shape: flow releases
            out[i] = ParamState(m, a, s, steps[i])
    return out
