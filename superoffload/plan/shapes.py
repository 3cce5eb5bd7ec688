"""Model description for the planner: parameter counts, FLOPs, activation memory.

A decoder-only transformer: token embedding (optionally tied with the LM head), `layers`
identical blocks, a final norm and the head. The default block is our GPT's (GPT-2: fused QKV
with biases, a GELU MLP of 4 x hidden, two LayerNorms; superoffload/models/gpt.py); Llama-style
blocks set `kv_heads` / `head_dim` (GQA), `gated_mlp` (SwiGLU), `bias=False`, and MoE blocks
`experts` / `experts_per_token`. Every formula (parameters, FLOPs on the active parameters,
activations after Korthikanti et al. 2022, element-wise traffic, device operations) is in
plan/formulas.py, with its sources; `from_module` reads a real module (plan/module_shape.py)
and `from_hf_config` a Hugging Face config (plan/hf_config.py, plan/hf_meta.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from superoffload.plan import formulas
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
    """Data-parallel ranks one replica's state is sharded over (FSDP2, as
    ``FsdpOffloadEngine`` runs it): each holds 1/dp of the weights, gradients and offloaded
    optimizer state and steps 1/dp of every bucket. `micro_batch` is per rank; times, FLOP/s
    and memory the planner reports are per rank (plan/parallel.py)."""
    dp_replicate: int = 1
    """Replicas of the sharded state (HSDP over a 2-D mesh, replicate x shard; ``train
    --dp-replicate``): the job runs ``dp * dp_replicate`` ranks, and every reduce-scatter is
    followed by an all-reduce of the reduced shard across the replicas."""
    ranks_per_host: int = 1
    """Ranks sharing one host's CPU cores, memory and memory bandwidth (1 on GH200: one Grace
    per GPU; e.g. 8 on an 8-GPU PCIe server). At most ``dp * dp_replicate``."""
    dtype: str = "bfloat16"
    """Dtype of the trainable parameters ("float32", "bfloat16", "float16"): the rule book's
    ``model_dtype`` (an fp32 model casts nothing and moves 4 B each way); the memory model
    counts weights and gradients at its size (plan/memory.py)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: `heads`."""
    head_dim: int | None = None
    """Width of one head; None: hidden / heads (Gemma-2: 256 with hidden 3584 / 16 heads)."""
    gated_mlp: bool = False
    """A gated MLP (SwiGLU: gate, up and down projections, 3 h x f) instead of GELU's two."""
    bias: bool = True
    """Linear layers and norms carry biases (GPT-2); False: Llama-style (RMSNorm, no bias)."""
    dropout_masks: bool = True
    """Dropout is on and its masks are stored (GPT-2); False for dropout-free models."""
    experts: int = 0
    """Experts per MoE block (0: a dense MLP)."""
    experts_per_token: int = 0
    """Experts each token is routed to (MoE top-k)."""
    active_block_params_override: int | None = None
    """Set from a module: the parameters one token runs through in a block (MoE: the router
    and k of the E experts); FLOPs use it, memory the whole block."""
    param_table: tuple[tuple[int, int], ...] | None = None
    """(layer, numel) of every trainable parameter in registration order, a tied parameter
    once -- the list the engine buckets (``plan.buckets.plan_buckets``). Layer 0 holds what
    is registered before the blocks (embeddings), 1..layers the blocks, layers + 1 what
    follows them (final norm, an untied head). Set by `from_module`; None synthesises the
    list our GPT registers (see `param_layout`)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch", "dp",
                     "dp_replicate", "ranks_per_host"):
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
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelShape.{name}={value!r}: use a whole number >= 1 or None")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"ModelShape.kv_heads={self.kv_heads} does not divide heads="
                             f"{self.heads}: each key/value head serves a whole group")
        if self.experts < 0 or not 0 <= self.experts_per_token <= self.experts or (
                self.experts and not self.experts_per_token):
            raise ValueError(f"ModelShape.experts={self.experts}, experts_per_token="
                             f"{self.experts_per_token}: use 0 and 0 (dense) or 1 <= "
                             "experts_per_token <= experts")
        if self.ranks_per_host > self.dp * self.dp_replicate:
            ranks = f"dp={self.dp}"
            if self.dp_replicate > 1:
                # name the replicate factor only when it is part of the product
                ranks += f" x dp_replicate={self.dp_replicate}"
            raise ValueError(
                f"ModelShape.ranks_per_host={self.ranks_per_host} exceeds {ranks}: a host "
                "cannot hold more data-parallel ranks than there are"
            )

    # ------------------------------------------------------------------ parameters
    @property
    def dtype_bytes(self) -> float:
        """Bytes of one element in the model's dtype: 4 for float32, 2 for the 16-bit ones."""
        return 4.0 if self.dtype == "float32" else 2.0

    @property
    def ffn(self) -> int:
        # GPT-2's MLP width when the config does not give one
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        if self.block_params_override is not None:
            return self.block_params_override
        return formulas.block_params(self)

    @property
    def active_block_params(self) -> int:
        """Parameters one token runs through in a block (MoE: router + k of E experts)."""
        return formulas.active_block_params(self)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (all of them for a dense model)."""
        return self.params - self.layers * (self.block_params - self.active_block_params)

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embeddings; includes the head when tied."""
        pos = self.seq * self.hidden if self.learned_positions else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head's own weight (0 when tied to the embedding)."""
        # LayerNorm (weight and bias) in the biased GPT-2 family, RMSNorm (weight) otherwise
        norm = (2 if self.bias else 1) * self.hidden
        if self.tied_embeddings:
            # the head is the embedding's weight, counted once in embedding_params
            return norm
        return norm + self.vocab * self.hidden

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
            # Only the total outside the blocks is known: give the head its final norm (2h)
            # and the embedding the rest, so the layer sums match the override.
            emb = self.other_params_override - 2 * self.hidden
            head = min(2 * self.hidden, self.other_params_override)
            return [max(emb, 0), *[self.block_params] * self.layers, head]
        return [self.embedding_params, *[self.block_params] * self.layers, self.head_params]

    # ------------------------------------------------------------------ parameter list
    def _block_pattern(self) -> list[int]:
        """One block in registration order (plan/formulas.block_pattern): our GPT's
        (superoffload/models/gpt.py ``Block``) by default; sums to `block_params`."""
        return formulas.block_pattern(self)

    @property
    def n_param_tensors(self) -> int:
        """Length of the parameter list, without building it (the simulator's size limit,
        plan/size_limit.py)."""
        if self.param_table is not None:
            return len(self.param_table)
        if self.block_params_override is not None or self.other_params_override is not None:
            return self.layers + 2
        # wte [+ wpe], the blocks, ln_f (weight [+ bias]), lm_head unless tied (param_layout)
        return (1 + int(self.learned_positions) + len(self._block_pattern()) * self.layers
                + (2 if self.bias else 1) + int(not self.tied_embeddings))

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
        pre = [self.vocab * self.hidden]
        if self.learned_positions:
            pre.append(self.seq * self.hidden)
        post = [self.hidden] * (2 if self.bias else 1)
        if not self.tied_embeddings:
            # a tied head is the embedding, registered once
            post.append(self.vocab * self.hidden)
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

    def block_of_params(self) -> tuple[int, ...]:
        """Per parameter of ``param_specs``: its block (0-based), or -1 outside the blocks
        (embeddings, final norm, head): what the FSDP2 units are cut from
        (plan/fsdp_units.py)."""
        layer, _ = self.param_layout()
        # param_layout's layer 0 is the embedding and layers + 1 the head: both outside
        return tuple(int(k) - 1 if 1 <= k <= self.layers else -1 for k in layer.tolist())

    # ------------------------------------------------------------------ FLOPs
    @property
    def tokens(self) -> int:
        """Tokens per micro-batch (one iteration, no accumulation)."""
        return self.seq * self.micro_batch

    def layer_forward_flops(self) -> list[float]:
        """Forward FLOPs per layer per iteration, forward order; the head is the V x h matmul."""
        t = self.tokens
        # 2 FLOPs per multiply-add over the active parameters: an MoE token skips idle experts
        block = t * (2.0 * self.active_block_params + formulas.attention_flops_per_token(self))
        # the embedding is a gather (no FLOPs); the head's matmul is counted even when tied
        return [0.0, *[block] * self.layers, t * 2.0 * self.vocab * self.hidden]

    def layer_forward_bytes(self) -> list[float]:
        """Element-wise (non-GEMM) bytes per layer, forward, in the model's dtype
        (plan/formulas.py); backward moves twice as many, a recompute once more."""
        t, size = self.tokens, self.dtype_bytes
        block = t * size * formulas.nongemm_elements_per_token(self)
        edge = t * size * formulas.edge_nongemm_elements_per_token(self)
        # the edge traffic split evenly between the embedding and the head layers
        return [edge / 2, *[block] * self.layers, edge / 2]

    def layer_forward_ops(self) -> list[float]:
        """Device operations per layer, forward (plan/formulas.py); backward 2x."""
        block = formulas.ops_per_block(self)
        return [formulas.OPS_EDGE / 2, *[block] * self.layers, formulas.OPS_EDGE / 2]

    def layer_backward_flops(self) -> list[float]:
        """Backward FLOPs per layer (2 x forward), plus the block recompute when checkpointing."""
        fwd = self.layer_forward_flops()
        rec = 1.0 if self.activation_checkpointing else 0.0
        out = [2.0 * f for f in fwd]
        # only the blocks are checkpointed: the embedding and head are not recomputed
        for i in range(1, self.layers + 1):
            out[i] += rec * fwd[i]
        return out

    @property
    def model_flops(self) -> float:
        """Useful FLOPs per iteration (forward + backward, no recompute): ~6 N tokens +
        attention."""
        return 3.0 * sum(self.layer_forward_flops())

    @property
    def executed_flops(self) -> float:
        """FLOPs the device executes per iteration, recompute included (~8 N tokens with ckpt)."""
        return sum(self.layer_forward_flops()) + sum(self.layer_backward_flops())

    # ------------------------------------------------------------------ activations
    def layer_activation_bytes(self) -> list[float]:
        """Bytes autograd keeps per layer at the end of forward, forward order [embedding,
        block x layers, head] (plan/formulas.py): with checkpointing a block keeps only its
        input (2sbh); the embedding its token ids, the head its norm and head inputs and the
        loss's fp32 log-softmax."""
        s, b, h = self.seq, self.micro_batch, self.hidden
        tokens = float(s * b)
        if self.activation_checkpointing:
            block = 2.0 * tokens * h
        else:
            block = tokens * formulas.activation_bytes_per_token(self)
        emb, head = formulas.edge_activation_bytes_per_token(self)
        # learned positions keep their int64 ids (8 B each), shared by the micro-batch
        positions = 8.0 * s if self.learned_positions else 0.0
        return [tokens * emb + positions, *[block] * self.layers, tokens * head]

    def saved_activation_bytes(self) -> float:
        """Bytes autograd keeps for backward at the end of forward (all layers)."""
        return float(sum(self.layer_activation_bytes()))

    def recompute_bytes(self) -> float:
        """With checkpointing: one block's activations, recomputed and held during its
        backward (0 without checkpointing: they are already kept)."""
        if not self.activation_checkpointing:
            return 0.0
        return float(self.seq * self.micro_batch) * formulas.activation_bytes_per_token(self)

    def loss_transient_bytes(self) -> float:
        """The loss's fp32 gradients at the start of backward: an allocator transient no
        tensor keeps (plan/formulas.py)."""
        return float(self.seq * self.micro_batch) * formulas.loss_transient_bytes_per_token(self)

    def activation_bytes(self) -> float:
        """Peak activation memory on the device: what autograd keeps plus the larger of the
        loss's transient gradients and one recomputed block (a bound; plan/memory.py places
        each at its moment of backward)."""
        # The loss transient lives at the start of backward, the recompute later: never both.
        return self.saved_activation_bytes() + max(self.loss_transient_bytes(),
                                                   self.recompute_bytes())

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
        """Describe an `nn.Module` (plan/module_shape.py): the blocks are its longest
        `nn.ModuleList`, the vocabulary and width come from its largest `nn.Embedding`,
        heads from an `n_head`/`num_heads`/`num_attention_heads` attribute (or hidden/64);
        a Hugging Face model's config adds GQA, head width, gated MLP and MoE experts (FLOPs
        on the active ones). Records the trainable parameters in registration order
        (`param_table`, a tied one once, as ``named_parameters`` lists them for the engine)
        and their dtype. Only counts parameters and shapes (a meta-device model works)."""
        from superoffload.plan.module_shape import shape_fields

        return cls(**shape_fields(module, seq=seq, micro_batch=micro_batch,
                                  activation_checkpointing=activation_checkpointing))
