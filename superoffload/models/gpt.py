"""A compact GPT (decoder-only transformer) for the main job, the benchmarks and the tests.

Follows GPT-2 (Radford et al. 2019) as re-implemented by nanoGPT (Karpathy): learned token and
position embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final
LayerNorm and a language-model head tied to the token embedding (Press & Wolf 2017). Attention
uses `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, which picks the
flash / memory-efficient kernel on CUDA and a fused path on the CPU.

The tied head matters to the engine: the embedding's gradient is accumulated twice per
backward (head and lookup), so its post-accumulate-grad hook fires twice (DESIGN.md §3.2).

    model = GPT(gpt_tiny())
    logits = model(idx)              # (B, T, vocab)
    loss = model(idx, targets)       # scalar mean cross-entropy, fp32
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT. Presets: `gpt_tiny()`, `gpt_small()`, `gpt_medium()`, `gpt2_124m()`."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level tokenizer of `superoffload.data`."""
    block_size: int = 128
    """Longest sequence (number of learned positions)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (embeddings, attention output, MLP output)."""
    bias: bool = True
    """Bias in Linear and LayerNorm layers (GPT-2 has them)."""
    checkpointing: bool = False
    """Activation checkpointing per block: recompute activations in backward to save memory."""

    def validate(self) -> GPTConfig:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: use a whole number >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "choose n_head that divides n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig.dropout={self.dropout!r} is invalid: use a value in [0, 1)")
        return self

    def to_dict(self) -> dict[str, int | float | bool]:
        return asdict(self)


def _preset(shape: dict[str, int], overrides: dict[str, int | float | bool]) -> GPTConfig:
    return GPTConfig(**{**shape, **overrides}).validate()  # type: ignore[arg-type]


def gpt_tiny(**overrides: int | float | bool) -> GPTConfig:
    """~0.12 M parameters: unit tests and CI (2 layers, width 64, 64 positions)."""
    return _preset({"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}, overrides)


def gpt_small(**overrides: int | float | bool) -> GPTConfig:
    """~0.84 M parameters: the default demo on 2 CPU cores (4 layers, width 128)."""
    return _preset({"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}, overrides)


def gpt_medium(**overrides: int | float | bool) -> GPTConfig:
    """~25 M parameters: a GPU demo and the engine benchmark (8 layers, width 512)."""
    return _preset({"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 256}, overrides)


def gpt2_124m(**overrides: int | float | bool) -> GPTConfig:
    """GPT-2 small's shape (12 layers, width 768, 1024 positions) with a byte vocabulary."""
    return _preset({"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}, overrides)


def gpt_2b(**overrides: int | float | bool) -> GPTConfig:
    """~2.2 B parameters (28 layers, width 2560, 256 positions): its fp32 optimizer state
    (26 GB) exceeds a 24 GiB host, the storage tier's proving run (docs/storage.md)."""
    return _preset({"n_layer": 28, "n_head": 20, "n_embd": 2560, "block_size": 256}, overrides)


PRESETS = {"tiny": gpt_tiny, "small": gpt_small, "medium": gpt_medium, "gpt2": gpt2_124m,
           "2b": gpt_2b}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. `model(idx)` -> logits; `model(idx, targets)` -> loss."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = (cfg or GPTConfig()).validate()
        c = self.config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        # weight tying (Press & Wolf 2017)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 §2.3: scale the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """idx: (B, T) int64 token ids with T <= block_size. Returns logits (B, T, vocab)
        when `targets` is None, else the mean cross-entropy over all positions (fp32 scalar)."""
        if idx.dim() != 2:
            raise ValueError(
                f"GPT.forward: idx must be (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {t} exceeds block_size={self.config.block_size}; "
                "use a shorter sequence or a larger GPTConfig.block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.config.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # cross-entropy in fp32 even for bf16/fp16 weights: the softmax over 256+ classes
        # loses ~2 digits in bf16
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self, *, include_position: bool = True) -> int:
        """Distinct parameters (the tied head is counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_position else n - self.wpe.weight.numel()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12*L*d*T for attention
        (Kaplan et al. 2020, Appendix; PaLM Appendix B)."""
        c = self.config
        return 6.0 * self.num_params(include_position=False) + 12.0 * c.n_layer * c.n_embd * seq_len

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `idx` (B, T); greedy when temperature == 0.
        `top_k` keeps only the k likeliest tokens before sampling (nanoGPT's `generate`; Fan
        et al. 2018, "Hierarchical Neural Story Generation")."""
        if temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"generate: temperature={temperature!r} must be >= 0 and "
                             f"top_k={top_k!r} None or >= 1")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
