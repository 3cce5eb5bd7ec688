"""Per-rank data, loss and gradient helpers of Ulysses sequence parallelism (any model).

Recipe (one training step on a sequence-parallel group of P ranks; docs/distributed.md):

    apply_ulysses(model, sp_group)                        # before the engine hooks the params
    idx_r, tgt_r = split_sequence(idx, sp_group), split_sequence(targets, sp_group)
    loss_r = model(idx_r, tgt_r)                          # mean CE over this rank's S/P tokens
    loss_r.backward()
    average_gradients(model.parameters(), world_group)    # d(global mean)/d(theta)
    loss = mean_over_group(loss_r.detach(), sp_group)     # for logging: the global mean

Why the gradient average is right: every rank back-propagates its own local mean L_r, and the
all-to-all backward routes each rank's output gradient to the ranks that computed it, so rank
r's parameter gradient is d(sum_r' L_r')/d(theta) restricted to rank r's tokens. Summing over
ranks gives d(sum_r L_r)/d(theta) = P * d(L)/d(theta) for the global mean L = mean_r L_r
(equal token counts per rank), hence an all-reduce *average*. With dp x sp the same average
over all dp*sp ranks also averages the data-parallel replicas.

Making a model's attention sequence-parallel is model-specific: our GPT's adapter is
``ulysses_gpt.apply_ulysses`` (loaded on demand, not by ``import superoffload.distributed``);
other models call ``ulysses.ulysses_attention`` in their attention (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from superoffload.distributed.process_group import collective_guard
from superoffload.distributed.ulysses import (
    check_sequence_split,
    group_rank,
    group_size,
)


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of `x` along `dim` (tokens, targets, position ids,
    attention masks): rank r of P gets positions [r*S/P, (r+1)*S/P)."""
    p = group_size(group)
    check_sequence_split(x.shape[dim], p)
    return x.chunk(p, dim=dim)[group_rank(group)]


def sequence_positions(seq_len: int, group: dist.ProcessGroup | None = None, *,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Global position ids of this rank's slice of a `seq_len` sequence (for models that take
    position_ids, e.g. Hugging Face's: pass them so RoPE/learned positions stay global)."""
    t_local = check_sequence_split(seq_len, group_size(group))
    start = group_rank(group) * t_local
    return torch.arange(start, start + t_local, device=device)


def average_gradients(params: Iterable[nn.Parameter],
                      group: dist.ProcessGroup | None = None) -> None:
    """All-reduce-average the .grad of every parameter over `group` (one flat buffer per
    dtype). Pass the group of all ranks that hold distinct tokens of the global batch."""
    if group_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        with collective_guard("all_reduce (average_gradients)", group):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= group_size(group)
        offset = 0
        for g in same:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def average_gradients_in_backward(params: Iterable[nn.Parameter],
                                  group: dist.ProcessGroup | None = None) -> list[RemovableHandle]:
    """Average every parameter's gradient over `group` *as backward produces it*, before it is
    accumulated into .grad; returns the hook handles (``.remove()`` to stop).

    For an engine that consumes gradients inside backward (the single-process OffloadEngine,
    also under weight-flow, moves each bucket to the host as its last gradient accumulates),
    `average_gradients` after backward is too late. With this hook every rank's engine sees
    the group-averaged gradient and steps a *replicated* optimizer state identically (the
    sum of an all-reduce is the same on every rank). Cost: one synchronous all-reduce per
    parameter tensor and backward, not bucketed, not overlapped: a correctness path for
    Ulysses + weight-flow (docs/distributed.md), not a fast one. Collective: call on every
    rank of the world, in the same order (it creates a dedicated communicator, so these
    all-reduces never interleave with another thread's collectives on `group`).
    """
    # without a process group (one process, tests) the group's ranks are 0..size-1
    if dist.is_initialized() and group is not None:
        ranks = dist.get_process_group_ranks(group)
    else:
        ranks = list(range(group_size(group)))
    if len(ranks) == 1:
        return []
    own = dist.new_group(ranks)
    n = len(ranks)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        with collective_guard("all_reduce (average_gradients_in_backward)", own):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=own)
        return out.div_(n)

    return [p.register_hook(hook) for p in params if p.requires_grad]


def mean_over_group(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average of a (detached) tensor over `group`: the global mean loss from local means."""
    out = value.detach().clone()
    if group_size(group) > 1:
        with collective_guard("all_reduce (mean_over_group)", group):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out /= group_size(group)
    return out
