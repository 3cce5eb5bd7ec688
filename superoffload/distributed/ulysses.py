"""DeepSpeed-Ulysses sequence-parallel attention (Jacobs et al. 2023, arXiv 2309.14509, §3).

Legend: B batch, H heads, S full sequence length, P sequence-parallel group size, D head dim.

Each of the P ranks holds a contiguous S/P slice of every sequence. Everything outside
attention (embeddings, LayerNorm, MLP, the loss) is per token and runs on the local slice.
Attention needs every key for every query, so Ulysses trades the sequence split for a head
split around it:

    q, k, v on rank r:  [B, H, S/P, D]   (sequence chunk r, all heads)
      -- all-to-all: scatter heads, gather sequence -->
                        [B, H/P, S, D]   (all positions, head chunk r)
      -- exact (causal) softmax attention over the whole sequence, per head -->
      -- all-to-all: scatter sequence, gather heads -->
    out on rank r:      [B, H, S/P, D]

Rank r sends head chunk j of its sequence chunk to rank j and receives from rank j sequence
chunk j of its own head chunk; concatenating the received chunks in rank order restores the
sequence order, so causal masking on the gathered sequence is the ordinary lower triangle.
Attention is independent per head, hence the result equals unsplit attention exactly (up to
floating-point summation order). Each all-to-all moves (P-1)/P of the local activations: per
layer 4 all-to-alls of B*H*S*D/P elements each way (q, k, v, out) in forward, 4 in backward.

The all-to-all is a permutation of data between ranks, so its adjoint is the inverse
permutation: backward is the all-to-all with the scatter and gather dims swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from superoffload.distributed.process_group import collective_guard


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of `group` (the default group when None); 1 when torch.distributed is not up."""
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not "
                               "initialised: call init_distributed() first")
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def check_ulysses_shapes(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], sp: int) -> None:
    """Validate [B, H, S/P, D] inputs for a group of `sp` ranks (pure; raises ValueError)."""
    if len(q_shape) != 4 or len(kv_shape) != 4:
        raise ValueError(f"ulysses_attention: q, k, v must be [batch, heads, seq/P, head_dim], "
                         f"got q {list(q_shape)} and k/v {list(kv_shape)}")
    (b, h, s, d), (bk, hk, sk, dk) = q_shape, kv_shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(f"ulysses_attention: q {list(q_shape)} and k/v {list(kv_shape)} differ "
                         "in batch, sequence or head_dim: pass tensors of one attention call")
    if hk < 1 or h % hk:
        raise ValueError(f"ulysses_attention: {h} query heads are not a multiple of {hk} key/value "
                         "heads: grouped-query attention needs q heads = k heads * group")
    for name, heads in (("query", h), ("key/value", hk)):
        if heads % sp:
            raise ValueError(
                f"ulysses_attention: {heads} {name} heads are not divisible by the "
                f"sequence-parallel group size {sp}: Ulysses gives each rank heads/{sp} whole "
                f"heads; use --sp that divides {heads}, or a model whose head count is a multiple "
                f"of {sp}"
            )


def check_sequence_split(seq_len: int, sp: int) -> int:
    """Local length of a `seq_len` sequence split over `sp` ranks; ValueError if uneven."""
    if seq_len % sp:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the sequence-parallel group size "
            f"{sp}: pad or crop the sequence to a multiple of {sp} (e.g. "
            f"{(seq_len // sp + 1) * sp}), or use an --sp that divides {seq_len}"
        )
    return seq_len // sp


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Split x into P chunks along scatter_dim, send chunk j to rank j, and concatenate what
    arrives from ranks 0..P-1 along gather_dim."""
    p = group_size(group)
    if p == 1:
        return x
    # Stack the outgoing chunks on a new leading dim: all_to_all_single sends send[j] to rank j
    # and writes rank j's chunk into recv[j] (equal splits).
    send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    with collective_guard("all_to_all_single (Ulysses attention)", group):
        dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all; backward is the inverse all-to-all (the adjoint of a
    permutation is its inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int,  # type: ignore[override]
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, H, S/P, D] (sequence shard) -> [B, H/P, S, D] (head shard), differentiable."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, H/P, S, D] (head shard) -> [B, H, S/P, D] (sequence shard), differentiable."""
    return _AllToAll.apply(x, 2, 1, group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, *, causal: bool = True,
                      dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Sequence-parallel scaled_dot_product_attention.

    q: [B, H, S/P, D] and k, v: [B, Hkv, S/P, D] — this rank's contiguous chunk of the
    sequence (rank r of `group` holds positions [r*S/P, (r+1)*S/P)); every rank of `group`
    calls it with the same shapes. Returns [B, H, S/P, D], equal to the matching slice of
    attention over the whole sequence. Hkv < H (grouped-query attention) is supported when both
    are divisible by P. `group=None` uses the default group; P=1 is plain SDPA.
    """
    p = group_size(group)
    check_ulysses_shapes(tuple(q.shape), tuple(k.shape), p)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"ulysses_attention: k {list(k.shape)} and v {list(v.shape)} differ: "
                         "pass key and value of the same shape")
    q_h, k_h, v_h = (seq_to_heads(t, group) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal, dropout_p=dropout_p,
                                       scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return heads_to_seq(y, group)


class UlyssesAttention(nn.Module):
    """`ulysses_attention` bound to a group, as a module (no parameters)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, causal: bool = True) -> None:
        super().__init__()
        self.group, self.causal = group, causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        return ulysses_attention(q, k, v, self.group, causal=self.causal, dropout_p=dropout_p,
                                 scale=scale)
