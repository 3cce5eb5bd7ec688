"""Model description for the planner: parameter counts, FLOPs, activation memory.

A GPT-style decoder (the models the paper trains): token embedding (optionally tied with the
LM head), `layers` identical blocks (attention 4h^2+4h, MLP 2hf+f+h, two LayerNorms 4h),
a final norm and the head. Formulas:
  FLOPs per token, forward, per block = 2 * block_params + 4 * seq * hidden   (matmuls + QK^T, AV)
  backward = 2 x forward; activation checkpointing recomputes the block forwards (+1 x)
    (Narayanan et al. 2021, "Efficient large-scale LM training on GPU clusters", §5.1)
  activations per block, bf16 = seq*mb*hidden*(34 + 5*heads*seq/hidden) bytes; flash attention
    drops the 5*heads*seq/hidden term; checkpointing keeps only each block's input (2*s*b*h)
    plus one block's full activations (Korthikanti et al. 2022, "Reducing activation
    recomputation", §4).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.plan.buckets import ParamSpec

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder-only transformer by its shape numbers."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int = 1
    activation_checkpointing: bool = True
    """Recompute each block's forward in backward (paper §5: used for the large models)."""
    ffn_hidden: int | None = None
    """MLP width; None means 4 * hidden."""
    tied_embeddings: bool = True
    flash_attention: bool = True
    """No seq^2 attention-score activations are stored."""
    learned_positions: bool = False
    """GPT-2 style position table of seq x hidden parameters."""
    block_params_override: int | None = None
    """Set by `from_module` with the measured count of one block's parameters."""
    other_params_override: int | None = None
    """Set by `from_module`: parameters outside the blocks (embeddings, final norm, head)."""
    dp: int = 1
    """Data-parallel ranks (ZeRO-style, issue 7): each holds 1/dp of the offloaded optimizer
    state and steps 1/dp of every bucket. `micro_batch` is per rank; times, FLOP/s and memory
    the planner reports are per rank (plan/parallel.py)."""
    ranks_per_host: int = 1
    """Ranks sharing one host's CPU cores, memory and memory bandwidth (1 on GH200: one Grace
    per GPU; e.g. 8 on an 8-GPU PCIe server). At most `dp`."""
    dtype: str = "bfloat16"
    """Dtype of the trainable parameters ("float32", "bfloat16", "float16"): the rule book's
    ``model_dtype`` (an fp32 model casts nothing and moves 4 B each way). The memory model
    counts 16-bit weights and gradients whatever the dtype (plan/memory.py)."""
    param_table: tuple[tuple[int, int], ...] | None = None
    """(layer, numel) of every trainable parameter in registration order, a tied parameter
    once -- the list the engine buckets (``plan.buckets.plan_buckets``). Layer 0 holds what
    is registered before the blocks (embeddings), 1..layers the blocks, layers + 1 what
    follows them (final norm, an untied head). Set by `from_module`; None synthesises the
    list our GPT registers (see `param_layout`)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch", "dp",
                     "ranks_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelShape.{name}={value!r}: use a whole number >= 1")
        if self.hidden % self.heads:
            raise ValueError(
                f"ModelShape.heads={self.heads} does not divide hidden={self.hidden}: "
                "pick heads so hidden/heads is a whole head size"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelShape.dtype={self.dtype!r}: use one of {DTYPES}")
        if self.param_table is not None:
            top = self.layers + 1
            for layer, numel in self.param_table:
                if not (0 <= layer <= top and numel >= 0):
                    raise ValueError(f"ModelShape.param_table holds ({layer}, {numel}): use "
                                     f"(layer in [0, {top}], numel >= 0) pairs")
        if self.ranks_per_host > self.dp:
            raise ValueError(
                f"ModelShape.ranks_per_host={self.ranks_per_host} exceeds dp={self.dp}: "
                "a host cannot hold more data-parallel ranks than there are"
            )

    # ------------------------------------------------------------------ parameters
    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        if self.block_params_override is not None:
            return self.block_params_override
        h, f = self.hidden, self.ffn
        return (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embeddings; includes the head when tied."""
        pos = self.seq * self.hidden if self.learned_positions else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head's own weight (0 when tied to the embedding)."""
        return 2 * self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def params(self) -> int:
        """Total parameters."""
        if self.other_params_override is not None:
            return self.layers * self.block_params + self.other_params_override
        return self.layers * self.block_params + self.embedding_params + self.head_params

    def layer_params(self) -> list[int]:
        """Parameters per layer in forward order: [embedding, block x layers, head]."""
        if self.param_table is not None:
            layer, numel = self.param_layout()
            return np.bincount(layer, weights=numel, minlength=self.layers + 2).astype(
                np.int64).tolist()
        if self.other_params_override is not None:
            emb = self.other_params_override - 2 * self.hidden
            return [max(emb, 0), *[self.block_params] * self.layers, min(2 * self.hidden, self.other_params_override)]
        return [self.embedding_params, *[self.block_params] * self.layers, self.head_params]

    # ------------------------------------------------------------------ parameter list
    def _block_pattern(self) -> list[int]:
        """One block of our GPT in registration order (superoffload/models/gpt.py ``Block``):
        ln_1 (w, b), attn.qkv (w 3h x h, b), attn.proj (w, b), ln_2 (w, b), mlp.fc (w f x h,
        b), mlp.proj (w h x f, b); sums to `block_params`."""
        h, f = self.hidden, self.ffn
        return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]

    @property
    def n_param_tensors(self) -> int:
        """Length of the parameter list, without building it (the simulator's size guard)."""
        if self.param_table is not None:
            return len(self.param_table)
        if self.block_params_override is not None or self.other_params_override is not None:
            return self.layers + 2
        return (1 + int(self.learned_positions) + 12 * self.layers + 2
                + int(not self.tied_embeddings))

    def param_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(layer, numel) int64 arrays of every trainable parameter in registration order.

        From `param_table` when set (`from_module`); else the registration order of our GPT
        (superoffload/models/gpt.py): wte (vocab x h), wpe (seq x h, with learned positions),
        the blocks, ln_f (w, b), and lm_head (vocab x h) only when untied (a tied head is the
        embedding, registered once). Counts with overrides but no table: one "parameter"
        per layer (an approximation: buckets then cut at layer boundaries)."""
        if self.param_table is not None:
            arr = np.asarray(self.param_table, dtype=np.int64).reshape(-1, 2)
            return arr[:, 0].copy(), arr[:, 1].copy()
        top = self.layers + 1
        if self.block_params_override is not None or self.other_params_override is not None:
            numel = np.asarray(self.layer_params(), dtype=np.int64)
            return np.arange(top + 1, dtype=np.int64), numel
        pre = [self.vocab * self.hidden] + ([self.seq * self.hidden] if self.learned_positions else [])
        post = [self.hidden, self.hidden] + ([] if self.tied_embeddings else [self.vocab * self.hidden])
        block = np.asarray(self._block_pattern(), dtype=np.int64)
        numel = np.concatenate([np.asarray(pre, np.int64), np.tile(block, self.layers),
                                np.asarray(post, np.int64)])
        layer = np.concatenate([np.zeros(len(pre), np.int64),
                                np.repeat(np.arange(1, top, dtype=np.int64), len(block)),
                                np.full(len(post), top, np.int64)])
        return layer, numel

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """The parameter list as ``plan_buckets`` / ``resolve_schedule`` take it (indices in
        registration order, all trainable), as the engine builds it for this model."""
        _, numel = self.param_layout()
        return tuple(ParamSpec(i, int(n)) for i, n in enumerate(numel.tolist()))

    # ------------------------------------------------------------------ FLOPs
    @property
    def tokens(self) -> int:
        """Tokens per micro-batch (one iteration, no accumulation)."""
        return self.seq * self.micro_batch

    def layer_forward_flops(self) -> list[float]:
        """Forward FLOPs per layer per iteration, forward order; the head is the V x h matmul."""
        t = self.tokens
        block = t * (2.0 * self.block_params + 4.0 * self.seq * self.hidden)
        return [0.0, *[block] * self.layers, t * 2.0 * self.vocab * self.hidden]

    def layer_backward_flops(self) -> list[float]:
        """Backward FLOPs per layer (2 x forward), plus the block recompute when checkpointing."""
        fwd = self.layer_forward_flops()
        rec = 1.0 if self.activation_checkpointing else 0.0
        out = [2.0 * f for f in fwd]
        for i in range(1, self.layers + 1):
            out[i] += rec * fwd[i]
        return out

    @property
    def model_flops(self) -> float:
        """Useful FLOPs per iteration (forward + backward, no recompute): ~6 N tokens + attention."""
        return 3.0 * sum(self.layer_forward_flops())

    @property
    def executed_flops(self) -> float:
        """FLOPs the device executes per iteration, recompute included (~8 N tokens with ckpt)."""
        return sum(self.layer_forward_flops()) + sum(self.layer_backward_flops())

    # ------------------------------------------------------------------ activations
    def activation_bytes(self) -> float:
        """Peak activation memory on the device (bf16), plus fp32 logits and their gradient."""
        s, b, h, a = self.seq, self.micro_batch, self.hidden, self.heads
        per_block = s * b * h * (34.0 + (0.0 if self.flash_attention else 5.0 * a * s / h))
        logits = 2 * 4.0 * s * b * self.vocab
        if self.activation_checkpointing:
            return self.layers * 2.0 * s * b * h + per_block + logits
        return self.layers * per_block + logits

    def replace(self, **changes: Any) -> ModelShape:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ from a HF config
    @classmethod
    def from_hf_config(cls, config_or_path: Any, **kw: Any) -> ModelShape:
        """A Hugging Face causal LM (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX) from its config: a
        `transformers` config, a dict, a config.json path or directory, or a shipped name such
        as "llama-2-7b". `kw`: seq (default: the context length, at most 4096), micro_batch and
        other fields. Exact parameter counts (GQA, SwiGLU, tied head): plan/hf_config.py."""
        from superoffload.plan.hf_config import shape_fields

        return cls(**shape_fields(config_or_path, **kw))

    # ------------------------------------------------------------------ from a module
    @classmethod
    def from_module(cls, module: Any, *, seq: int, micro_batch: int = 1,
                    activation_checkpointing: bool = True) -> ModelShape:
        """Describe an `nn.Module`: the blocks are its longest `nn.ModuleList`; the vocabulary and
        width come from its largest `nn.Embedding`; heads from an `n_head`/`num_heads`/
        `num_attention_heads` attribute (or hidden/64). Only counts parameters and shapes.
        Records the trainable parameters in registration order (`param_table`, a tied one
        once, as ``named_parameters`` lists them for the engine) and their dtype."""
        import torch.nn as nn  # torch only to describe the module (DESIGN.md §2: plan is pure)

        if not isinstance(module, nn.Module):
            raise TypeError(f"ModelShape.from_module needs an nn.Module, got {type(module).__name__}")
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if not lists:
            raise ValueError("ModelShape.from_module: no nn.ModuleList of blocks found in the model")
        blocks = max(lists, key=len)
        embeds = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not embeds:
            raise ValueError("ModelShape.from_module: no nn.Embedding found (vocabulary unknown)")
        tok = max(embeds, key=lambda e: e.num_embeddings)
        seen: set[int] = set()

        def count(m: nn.Module) -> int:
            total = 0
            for p in m.parameters():
                if id(p) not in seen:  # tied weights count once
                    seen.add(id(p))
                    total += p.numel()
            return total

        block_total = count(blocks)
        total = block_total + count(module)
        heads = _find_heads(module) or max(1, tok.embedding_dim // 64)
        table, dtype = _param_table(module, blocks)
        return cls(
            layers=len(blocks),
            hidden=tok.embedding_dim,
            heads=heads if tok.embedding_dim % heads == 0 else 1,
            vocab=tok.num_embeddings,
            seq=seq,
            micro_batch=micro_batch,
            activation_checkpointing=activation_checkpointing,
            block_params_override=block_total // len(blocks),
            other_params_override=total - (block_total // len(blocks)) * len(blocks),
            dtype=dtype,
            param_table=table,
        )


def _param_table(module: Any, blocks: Any) -> tuple[tuple[tuple[int, int], ...], str]:
    """((layer, numel) per trainable parameter in ``named_parameters`` order, dtype name):
    block i's parameters are layer i + 1; those registered before the first block are layer
    0, the rest layer len(blocks) + 1. The dtype is the trainable parameters' (bfloat16 when
    they mix, the planner's default)."""
    in_block = {id(p): i + 1 for i, b in enumerate(blocks) for p in b.parameters()}
    top = len(blocks) + 1
    table: list[tuple[int, int]] = []
    dtypes: set[str] = set()
    seen_block = False
    for _, p in module.named_parameters():  # deduplicates tied parameters, as the engine sees
        if not p.requires_grad:
            continue
        layer = in_block.get(id(p))
        if layer is None:
            layer = top if seen_block else 0
        else:
            seen_block = True
        table.append((layer, int(p.numel())))
        dtypes.add(str(p.dtype).removeprefix("torch."))
    dtype = dtypes.pop() if len(dtypes) == 1 else "bfloat16"
    return tuple(table), dtype if dtype in DTYPES else "bfloat16"


def _find_heads(module: Any) -> int | None:
    for owner in (module, getattr(module, "config", None)):
        for attr in ("n_head", "num_heads", "num_attention_heads", "heads", "n_heads"):
            value = getattr(owner, attr, None) if owner is not None else None
            if isinstance(value, int) and value > 0:
                return value
    for sub in module.modules():
        for attr in ("n_head", "num_heads"):
            value = getattr(sub, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None

