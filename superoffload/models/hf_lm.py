"""Hugging Face causal-LM models for the main job, built from a tiny local config (no
download). `transformers` is optional (the "hf" extra); everything here imports it lazily.

The adapter gives a HF model the same contract as our GPT: `model(idx)` -> logits and
`model(idx, targets)` -> mean cross-entropy, with targets already shifted by the data
sampler (HF's own `labels=` would shift them a second time).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HF_MISSING = (
    "--hf needs the optional 'transformers' package: pip install 'superoffload[hf]' "
    "(a tiny GPT-2-shaped model is then built from a local config; nothing is downloaded)"
)


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class CausalLMAdapter(nn.Module):
    """Wraps a `transformers` causal LM: forward(idx, targets=None) -> logits or loss."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=idx).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def tiny_hf_causal_lm(
    *, vocab_size: int = 256, block_size: int = 128, n_layer: int = 4, n_embd: int = 128,
    n_head: int = 4, seed: int = 0,
) -> CausalLMAdapter:
    """A randomly initialised GPT-2-shaped `transformers` model (tied head, no dropout)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise ImportError(HF_MISSING) from exc
    config: Any = GPT2Config(
        vocab_size=vocab_size, n_positions=block_size, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return CausalLMAdapter(GPT2LMHeadModel(config))
