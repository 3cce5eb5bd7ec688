"""Make our GPT (superoffload/models/gpt.py) sequence-parallel with Ulysses.

We do not edit models/gpt.py: ``apply_ulysses`` swaps each block's attention for a module that
shares the original qkv/proj Linear layers (same parameters, same state_dict keys) and shifts
the positional-embedding lookup by the rank's sequence offset with a forward pre-hook. The
data, loss and gradient helpers of the recipe are in sequence_parallel.py (any model).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from superoffload.distributed.ulysses import group_rank, group_size, ulysses_attention
from superoffload.models.gpt import GPT, CausalSelfAttention

_HANDLES: weakref.WeakKeyDictionary[GPT, RemovableHandle] = weakref.WeakKeyDictionary()
"""The position-shift hook of each sequence-parallel model (removed by remove_ulysses)."""


class UlyssesSelfAttention(nn.Module):
    """GPT's CausalSelfAttention with the attention core replaced by ulysses_attention.
    Holds the *same* qkv/proj modules as the one it replaces."""

    def __init__(self, original: CausalSelfAttention, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.n_head, self.dropout = original.n_head, original.dropout
        self.qkv, self.proj, self.resid_drop = original.qkv, original.proj, original.resid_drop
        self.group = group
        # a list, so it is not registered as a submodule
        self.original = [original]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # t = S/P local positions
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = ulysses_attention(q, k, v, self.group, causal=True,
                              dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


def _position_shift_hook(group: dist.ProcessGroup | None, block_size: int):
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # GPT.forward looks up arange(S/P): shift to this rank's positions
        (pos,) = args
        p, t_local = group_size(group), pos.shape[-1]
        if t_local * p > block_size:
            raise ValueError(
                f"sequence-parallel GPT: {p} ranks x {t_local} local positions = {t_local * p} "
                f"exceeds block_size={block_size}: use shorter sequences or a larger block_size"
            )
        return (pos + group_rank(group) * t_local,)

    return hook


def apply_ulysses(model: GPT, group: dist.ProcessGroup | None = None) -> GPT:
    """Make `model` sequence-parallel over `group` in place and return it.

    Afterwards `model(idx_r, targets_r)` takes this rank's contiguous S/P slice of each
    sequence (see split_sequence) and returns the mean loss over the local tokens. Checks the
    head count now, so a bad --sp fails before the first step. Undo with remove_ulysses().
    """
    if not isinstance(model, GPT):
        raise TypeError(f"apply_ulysses: expected superoffload.models.GPT, got "
                        f"{type(model).__name__}; for other models call ulysses_attention in "
                        "their attention (docs/distributed.md)")
    if model in _HANDLES:
        raise ValueError("apply_ulysses: the model is already sequence-parallel; call "
                         "remove_ulysses(model) first to change the group")
    p = group_size(group)
    if model.config.n_head % p:
        raise ValueError(
            f"apply_ulysses: n_head={model.config.n_head} is not divisible by the "
            f"sequence-parallel group size {p}: use --sp that divides {model.config.n_head}"
        )
    for block in model.blocks:
        attn = block.attn
        if not isinstance(attn, CausalSelfAttention):
            raise TypeError(f"apply_ulysses: block attention is {type(attn).__name__}, expected "
                            "GPT's CausalSelfAttention")
        block.attn = UlyssesSelfAttention(attn, group)
    _HANDLES[model] = model.wpe.register_forward_pre_hook(
        _position_shift_hook(group, model.config.block_size))
    return model


def remove_ulysses(model: GPT) -> GPT:
    """Restore the single-process attention and positions (same parameters)."""
    handle = _HANDLES.pop(model, None)
    if handle is None:
        raise ValueError("remove_ulysses: the model is not sequence-parallel")
    handle.remove()
    for block in model.blocks:
        attn = block.attn
        if isinstance(attn, UlyssesSelfAttention):
            block.attn = attn.original[0]
    return model


