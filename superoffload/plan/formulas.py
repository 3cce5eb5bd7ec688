"""A decoder block's numbers from its shape: parameters, FLOPs, activations, memory traffic.

Pure functions of a ``ModelShape`` (plan/shapes.py reads them). Legend: ``h`` hidden, ``q``
query width = heads x head_dim, ``kv`` key/value width = kv_heads x head_dim (GQA: kv < q;
Ainslie et al. 2023), ``f`` MLP width, ``a`` heads, ``s`` sequence, ``b`` micro-batch,
``E`` experts, ``k`` experts per token (MoE; Fedus et al. 2022, Switch Transformers §2).

Parameters of one block (GPT-2 with biases and LayerNorms; Llama-style: no biases, RMSNorm):
  attention   h*q (Q) + 2*h*kv (K, V) + q*h (O)               [+ q + 2kv + h biases]
  MLP         GELU: 2*h*f [+ f + h];  gated (SwiGLU, Shazeer 2020): 3*h*f [+ 2f + h]
  MoE         E x the MLP + a router h*E; a token runs k of the E experts ("active")
  norms       2 x h (RMSNorm) or 2 x 2h (LayerNorm with bias)
FLOPs per token, forward: 2 x active matmul parameters + 4*s*q (QK^T and AV over the whole
  s x s score matrix, as torch.utils.flop_counter counts scaled_dot_product_attention);
  backward 2x, + 1x with activation checkpointing (Narayanan et al. 2021, §5.1).
Activations: what autograd keeps for backward, 16-bit unless said (Korthikanti et al. 2022
  §4.1, checked tensor by tensor against our GPT's saved tensors:
  tests/test_plan_device_memory.py).
  Per token of one block: norms 4h (their inputs) + statistics (LayerNorm: mean and rstd
  in fp32, 8 B each; RMSNorm: rstd, 4 B); attention 2h (QKV input) + 2q + 4kv (Q, K, V:
  our GPT's fused QKV output) + 2q (the output, shared with O's input) + 4a (the fp32
  log-sum-exp flash attention keeps) [+ h dropout mask]; without flash attention + 2as
  (softmax) [+ 3as dropout mask and output]; MLP GELU 2h + 2f + 2f [+ h mask]; gated 2h +
  8f (gate, up, act, product) [+ h]; MoE: k x the expert MLP + 4E router probabilities
  (fp32). Dropout masks are kept for GPT-2-style models with dropout on and not for
  dropout-free ones. Hugging Face Llama-style blocks keep a few more (rotary's pre-rotation
  Q and K): the same formula is an estimate there.
  Outside the blocks, per token: the token ids (int64, 8 B) [+ h embedding-dropout mask];
  the final norm's input 2h + statistics, the head's input 2h, the fp32 log-softmax of the
  logits 4V (the loss keeps it) and the targets (8 B); learned positions keep their ids
  (8 B per position). At the start of backward the loss adds two fp32 gradients of the
  logits (8V per token) that no tensor keeps: an allocator transient (loss_transient_bytes).
Non-GEMM memory traffic per token of one block, forward, in elements (read + write; the
  element-wise passes between the matmuls, bound by device memory bandwidth): norms 2 x 2h,
  residual adds 2 x 3h, attention core 2q + 2kv (flash reads Q, K, V, writes O) [+ 4as
  without flash], MLP activation 2f (GELU) or 5f (gated: act + product), MoE dispatch
  3kh + h + 3E (gather the k copies, combine, router top-k); backward 2x forward.
Device operations (kernel launches / dispatches) per block, forward: 18 (GPT: 2 norms, QKV,
  views, SDPA, O, 2 residual adds, 2 linears, GELU) + 4 gated + 6 per routed expert;
  backward 2x forward (autograd's nodes). The per-op cost is measured (plan/probe.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

OPS_PER_BLOCK = 18.0
"""Device operations of one GPT block's forward (module docstring)."""
OPS_GATED = 4.0
OPS_PER_EXPERT = 6.0
OPS_EDGE = 10.0
"""Embedding, final norm, head, loss: forward operations outside the blocks."""


def widths(s: Any) -> tuple[int, int, int, int]:
    """(h, q, kv, f) of shape `s` (defaults: head_dim = h / heads, kv_heads = heads)."""
    hd = s.head_dim if s.head_dim is not None else s.hidden // s.heads
    kv_heads = s.kv_heads if s.kv_heads is not None else s.heads
    return s.hidden, s.heads * hd, kv_heads * hd, s.ffn


def mlp_params(s: Any) -> int:
    """One (expert) MLP's parameters."""
    h, _, _, f = widths(s)
    if s.gated_mlp:
        # SwiGLU: gate, up and down projections; biases on gate and up (f each) and down (h).
        matrices, bias_numel = 3, 2 * f + h
    else:
        matrices, bias_numel = 2, f + h
    weights = matrices * h * f
    return weights + (bias_numel if s.bias else 0)


def block_params(s: Any) -> int:
    """Parameters of one block from the shape numbers (module docstring)."""
    h, q, kv, _ = widths(s)
    # K and V are kv wide, not q: grouped-query attention shares them across query heads.
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv + h) if s.bias else 0)
    if s.experts:
        # Every expert is stored even though a token runs only k of them; + the h x E router.
        mlp = mlp_params(s) * s.experts + h * s.experts
    else:
        mlp = mlp_params(s)
    # Two norms: LayerNorm (the biased GPT-2 family) has weight and bias, RMSNorm a weight only.
    norm_tensors = 2 if s.bias else 1
    return attn + mlp + 2 * h * norm_tensors


def active_block_params(s: Any) -> int:
    """Parameters one token runs through in a block: an MoE block's router and k of its E
    experts (the others idle for that token); the whole block otherwise."""
    if s.active_block_params_override is not None:
        return int(s.active_block_params_override)
    if not s.experts:
        return int(s.block_params)
    idle = (s.experts - s.experts_per_token) * mlp_params(s)
    return int(s.block_params) - idle


def _with_biases(layers: Sequence[tuple[int, int | None]], bias: bool) -> list[int]:
    """Each layer's weight numel followed by its bias numel when the model has biases (a bias
    of None: a layer that never has one, such as the MoE router)."""
    out: list[int] = []
    for weight, bias_numel in layers:
        out.append(weight)
        if bias and bias_numel is not None:
            out.append(bias_numel)
    return out


def block_pattern(s: Any) -> list[int]:
    """One block's parameters in registration order, summing to `block_params`: our GPT's
    (models/gpt.py: ln_1, fused qkv, proj, ln_2, fc, proj) for a GELU MLP with full heads,
    else the Llama order (q, k, v, o, the MLP or router + fused experts, the two norms)."""
    h, q, kv, f = widths(s)
    b = s.bias
    if not s.gated_mlp and q == kv == h and not s.experts:
        gpt = [(h, h), (3 * h * h, 3 * h), (h * h, h), (h, h), (f * h, f), (h * f, h)]
        # Zero-sized entries are dropped: the pattern lists tensors that exist.
        return [x for x in _with_biases(gpt, b) if x]
    attention: list[tuple[int, int | None]] = [(q * h, q), (kv * h, kv), (kv * h, kv), (h * q, h)]
    mlp: list[tuple[int, int | None]]
    if s.gated_mlp:
        mlp = [(f * h, f), (f * h, f), (h * f, h)]
    else:
        mlp = [(f * h, f), (h * f, h)]
    if s.experts:
        # transformers' fused experts: router (no bias), gate_up (E x up x h), down (E x h x f),
        # where a gated MLP fuses gate and up into one 2f-wide tensor.
        up = (2 if s.gated_mlp else 1) * f
        e = s.experts
        mlp = [(h * e, None), (e * up * h, e * up), (e * h * f, e * h)]
    norms: list[tuple[int, int | None]] = [(h, h), (h, h)]
    return _with_biases(attention + mlp + norms, b)


def attention_flops_per_token(s: Any) -> float:
    """QK^T and AV of one block, per token (full score matrix)."""
    return 4.0 * s.seq * widths(s)[1]


def norm_stats_bytes(s: Any) -> float:
    """Statistics one norm keeps per token: LayerNorm's mean and rstd (fp32), RMSNorm's rstd."""
    # A biased model is the GPT-2 family, whose norms are LayerNorms.
    return 8.0 if s.bias else 4.0


def activation_bytes_per_token(s: Any) -> float:
    """One block's stored activations per token, 16-bit (module docstring)."""
    h, q, kv, f = widths(s)
    a, seq, masks = s.heads, s.seq, s.dropout_masks
    # Q, K, V (our GPT's fused QKV output) and the attention output; a dropout mask after O.
    attn = 2 * h + 4 * q + 4 * kv + (h if masks else 0)
    if not s.flash_attention:
        # The s x s softmax per head is materialised, and with dropout its mask and output.
        attn += 2 * a * seq + (3 * a * seq if masks else 0)
    else:
        # Flash attention recomputes the scores; it keeps only the fp32 log-sum-exp per head.
        attn += 4 * a
    if s.gated_mlp:
        # gate, up, act, product
        mlp_inner = 8 * f
    else:
        mlp_inner = 4 * f
    mlp = 2 * h + mlp_inner + (h if masks else 0)
    if s.experts:
        # A token's activations pass through k experts only; the router keeps fp32 probabilities.
        mlp = s.experts_per_token * mlp + 4 * s.experts
    return float(4 * h + 2 * norm_stats_bytes(s) + attn + mlp)


def edge_activation_bytes_per_token(s: Any) -> tuple[float, float]:
    """(embedding, head) activations kept per token outside the blocks (module docstring)."""
    h = s.hidden
    # int64 token ids (8 B); models with dropout also keep the embedding-dropout mask.
    embedding = 8.0 + (h if s.dropout_masks else 0)
    # Final norm input 2h + its statistics, head input 2h, fp32 log-softmax 4V, int64 targets.
    head = 4 * h + norm_stats_bytes(s) + 4 * s.vocab + 8.0
    return embedding, float(head)


def loss_transient_bytes_per_token(s: Any) -> float:
    """fp32 gradients of the log-softmax output and of the logits, alive together at the start
    of backward (cross-entropy's backward), kept by no tensor: 8V per token."""
    return 8.0 * s.vocab


def nongemm_elements_per_token(s: Any) -> float:
    """One block's element-wise traffic per token, forward (module docstring)."""
    h, q, kv, f = widths(s)
    # Flash reads Q, K, V and writes O once; without it the s x s scores go through memory.
    scores = 0 if s.flash_attention else 4 * s.heads * s.seq
    core = 2 * q + 2 * kv + scores
    act = 5 * f if s.gated_mlp else 2 * f
    if s.experts:
        # Gather the k copies of each token, combine them, and the router's top-k over E.
        act = s.experts_per_token * act + 3 * s.experts_per_token * h + h + 3 * s.experts
    # Two norms (2 x 2h) and two residual adds (2 x 3h) besides the attention core and MLP.
    return float(4 * h + 6 * h + core + act)


def edge_nongemm_elements_per_token(s: Any) -> float:
    """Embedding gather (+ positions), final norm and the loss over the logits, forward."""
    # Learned positions add their own gather and the add into the embeddings.
    positions = 3 * s.hidden if s.learned_positions else 0
    return float(2 * s.hidden + positions + 2 * s.hidden + 3 * s.vocab)


def ops_per_block(s: Any) -> float:
    """Device operations of one block's forward (module docstring)."""
    gated = OPS_GATED if s.gated_mlp else 0.0
    return OPS_PER_BLOCK + gated + OPS_PER_EXPERT * (s.experts or 0)
