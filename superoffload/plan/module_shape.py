"""``ModelShape.from_module``: the planner's numbers read from a real ``nn.Module``.

Counts, never runs: a model on the meta device works (plan/hf_meta.py builds any Hugging Face
architecture that way). The blocks are the longest ``nn.ModuleList``; the vocabulary and width
come from the largest ``nn.Embedding``; a Hugging Face ``config`` adds what the parameter count
alone cannot say:

* grouped-query attention and the head width (``num_key_value_heads``, ``head_dim``; Falcon's
  ``multi_query``: one key/value head), for the attention FLOPs and activations;
* a gated MLP (a ``gate_proj`` / ``gate_up_proj`` / ``w1`` parameter in the block: SwiGLU);
* MoE: the experts' parameters are those under an ``experts`` module (a ``ModuleList`` of
  experts or transformers' fused ``gate_up_proj`` / ``down_proj`` tensors), shared experts
  excluded; with E experts (``num_local_experts`` / ``num_experts`` / ``n_routed_experts``) and
  k per token (``num_experts_per_tok`` / ``moe_topk``) a token runs k / E of them, so the
  active parameters of a block are the rest + k / E of the experts (the router is in the rest).
  Counted over every block: DeepSeek's first ``first_k_dense_replace`` blocks, Qwen-MoE's
  ``mlp_only_layers`` / ``decoder_sparse_step`` and ``moe_layer_freq`` make some blocks dense,
  so ``active_block_params_override`` is the blocks' mean (FLOPs use it times the blocks);
* dropout: masks are stored only when a dropout probability is above 0 (our GPT's
  ``GPTConfig.dropout`` too).
"""

from __future__ import annotations

from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERT_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout")
GATE_NAMES = ("gate_proj", "gate_up_proj", ".w1.", ".w3.")


def shape_fields(module: Any, *, seq: int, micro_batch: int = 1,
                 activation_checkpointing: bool = True) -> dict[str, Any]:
    """ModelShape's fields for `module` (module docstring)."""
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
    hidden = tok.embedding_dim
    # no attribute names the heads: assume the common head width of 64
    heads = find_heads(module) or max(1, hidden // 64)
    if hidden % heads:
        # a head count that does not divide the width is not this model's: fall back to one
        # head (the matmul FLOPs do not depend on it)
        heads = 1
    table, dtype = param_table(module, blocks)
    per_block = block_total // len(blocks)
    fields: dict[str, Any] = dict(
        layers=len(blocks), hidden=hidden, heads=heads, vocab=tok.num_embeddings, seq=seq,
        micro_batch=micro_batch, activation_checkpointing=activation_checkpointing,
        block_params_override=per_block,
        other_params_override=total - per_block * len(blocks), dtype=dtype, param_table=table)
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):  # a Hugging Face PretrainedConfig
        fields.update(_hf_details(cfg, blocks, heads, per_block))
    return fields


def _hf_details(cfg: Any, blocks: Any, heads: int, per_block: int) -> dict[str, Any]:
    """GQA, head width, gated MLP, dropout and MoE from an HF config and the blocks."""
    named = [(n, p) for b in blocks for n, p in b.named_parameters()]
    names = sorted({n for n, _ in named})
    out: dict[str, Any] = {"bias": any(n.endswith("bias") for n in names),
                           "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", True))}
    kv = _first_int(cfg, ("num_key_value_heads", "num_kv_heads"))
    if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        kv = 1  # Falcon-7B: one key/value head shared by all queries
    if kv and heads % kv == 0:
        out["kv_heads"] = kv
    head_dim = _first_int(cfg, ("head_dim",))
    if head_dim:
        out["head_dim"] = head_dim
    out["gated_mlp"] = any(g in f".{n}." for n in names for g in GATE_NAMES)
    ffn = _first_int(cfg, ("moe_intermediate_size", "intermediate_size", "ffn_hidden_size",
                           "n_inner"))
    if ffn:
        out["ffn_hidden"] = ffn
    drops = [float(v) for k in DROPOUT_KEYS if isinstance(v := getattr(cfg, k, None),
                                                          (int, float))]
    if drops:
        out["dropout_masks"] = any(d > 0 for d in drops)
    experts, topk = _first_int(cfg, EXPERT_COUNT_KEYS), _first_int(cfg, EXPERT_TOPK_KEYS)
    expert_numel = sum(p.numel() for n, p in named if _is_expert(n))  # every block's
    if experts and topk and expert_numel:
        k = min(topk, experts)
        out.update(experts=experts, experts_per_token=k,
                   active_block_params_override=per_block - round(
                       expert_numel * (1 - k / experts) / len(blocks)))
    return out


def _is_expert(name: str) -> bool:
    """A routed expert's parameter: under an ``experts`` module, not a shared expert."""
    parts = name.split(".")
    return "experts" in parts[:-1] and not any("shared" in p for p in parts)


def _first_int(cfg: Any, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def param_table(module: Any, blocks: Any) -> tuple[tuple[tuple[int, int], ...], str]:
    """((layer, numel) per trainable parameter in ``named_parameters`` order, dtype name):
    block i's parameters are layer i + 1; those registered before the first block are layer
    0, the rest layer len(blocks) + 1. The dtype is the trainable parameters' (bfloat16 when
    they mix, the planner's default)."""
    in_block = {id(p): i + 1 for i, b in enumerate(blocks) for p in b.parameters()}
    top = len(blocks) + 1
    table: list[tuple[int, int]] = []
    dtypes: set[str] = set()
    seen_block = False
    # named_parameters deduplicates tied parameters, as the engine sees them
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        layer = in_block.get(id(p))
        if layer is None:
            # outside the blocks: before the first block it is the embedding's layer, after
            # it the head's
            layer = top if seen_block else 0
        else:
            seen_block = True
        table.append((layer, int(p.numel())))
        dtypes.add(str(p.dtype).removeprefix("torch."))
    # mixed or unknown dtypes: the planner's 16-bit default
    dtype = "bfloat16"
    if len(dtypes) == 1 and (only := dtypes.pop()) in DTYPES:
        dtype = only
    return tuple(table), dtype


def find_heads(module: Any) -> int | None:
    """Attention heads from the model's (or its config's) usual attribute names."""
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
