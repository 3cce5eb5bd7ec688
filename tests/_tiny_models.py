"""Tiny GPT-like models for the engine's tests (independent of superoffload.models).

Layer sizes are deliberately unequal so buckets split unevenly and missing synchronisation
shows up as a value difference, not a coincidence (torchao's offload tests do the same).
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TinyGPT(nn.Module):
    """Embedding (tied with the output head), ``n_blocks`` MLP blocks, optional frozen layer."""

    def __init__(self, vocab: int = 61, dim: int = 24, hidden: int = 40, n_blocks: int = 3,
                 frozen: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        nn.init.normal_(self.wte.weight, std=0.1)
        self.wpe = nn.Parameter(torch.randn(16, dim) * 0.02)
        self.frozen = nn.Linear(dim, dim) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(dim, hidden + 8 * k) for k in range(n_blocks))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        if self.frozen is not None:
            x = x + self.frozen(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        flat = logits.view(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, targets.view(-1))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kw: object) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw).to(dtype)  # type: ignore[arg-type]


def batches(n: int, *, seed: int = 1, batch: int = 4, seq: int = 12, vocab: int = 61):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.roll(x, -1, dims=1)
        out.append((x, y))
    return out
