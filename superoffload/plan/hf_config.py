"""A Hugging Face causal LM's `config.json` -> the planner's ModelShape (no transformers needed).

Families and what differs from our GPT block (plan/shapes.py), as `transformers` 5.x registers
their parameters (each family's modeling file in huggingface/transformers):
  llama, mistral  GQA: q (heads*hd x h), k and v (kv_heads*hd x h), o (h x heads*hd); biases only
                  with `attention_bias` (q, k, v, o) / `mlp_bias`; SwiGLU MLP gate, up (f x h),
                  down (h x f); two RMSNorm weights; final norm; untied head by default
  qwen2           as llama, with q, k, v biases always and o without
  gpt2            fused c_attn (Conv1D h x 3h) with bias, c_proj, GELU MLP c_fc (h x f, f =
                  n_inner or 4h), two LayerNorms (w, b); learned positions; tied head
  gpt_neox        fused query_key_value (3h x h), dense, dense_h_to_4h / dense_4h_to_h, all
                  biased; two LayerNorms; rotary positions; untied head by default
hd = head_dim (default hidden / heads). A tied head is the embedding, counted once.

`parameter_shapes` lists every parameter (HF name, shape) in registration order -- the order the
engine buckets them -- and `shape_fields` gives a ModelShape (`ModelShape.from_hf_config`) with
exact block and non-block counts (`block_params_override`, `other_params_override`) and, where
ModelShape has it, the per-parameter `param_table`, with what the FLOP and activation formulas
need (GQA widths, a gated MLP, biases, dropout; plan/formulas.py). Any other ``model_type`` is
built on the meta device when transformers is installed (plan/hf_meta.py).

Shipped configs (`hf_configs/*.json`, config.json only, no weights) load by name offline:
    model_shape("llama-2-7b", seq=4096)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from superoffload.jsonfile import parse_object
from superoffload.plan.config_numbers import ConfigReader, check_param_count
from superoffload.plan.size_limit import check_counts

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gpt_neox")
DEFAULT_MAX_SEQ = 4096
"""`seq` when none is given: the config's context length, capped here."""
_SHIPPED_DIR = "hf_configs"

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HFArch:
    """What the parameter count needs from one config (family defaults filled in)."""

    family: str
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    positions: int
    """Context length (`max_position_embeddings` / `n_positions`)."""
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def shipped() -> list[str]:
    """Names of the configs that ship with the package (usable offline)."""
    root = resources.files("superoffload.plan").joinpath(_SHIPPED_DIR)
    if not root.is_dir():  # an install without the package data
        return []
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_config(config_or_path: Any) -> dict[str, Any]:
    """A plain dict from a `transformers.PretrainedConfig`, a dict, a `config.json` path, a
    directory holding one, or the name of a shipped config."""
    if isinstance(config_or_path, Mapping):
        return dict(config_or_path)
    to_dict = getattr(config_or_path, "to_dict", None)
    if callable(to_dict) and hasattr(config_or_path, "model_type"):
        return dict(to_dict())
    if not isinstance(config_or_path, (str, Path)):
        raise TypeError(
            f"from_hf_config: pass a transformers config, a dict, a config.json path or a shipped "
            f"name ({', '.join(shipped())}), not {type(config_or_path).__name__}")
    path = Path(config_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _parse(path.read_text(), str(path))
    name = str(config_or_path)
    if name in shipped():
        shipped_file = resources.files("superoffload.plan").joinpath(_SHIPPED_DIR, name + ".json")
        text = shipped_file.read_text()
        return _parse(text, f"shipped config {name}")
    raise FileNotFoundError(
        f"from_hf_config({name!r}): no such file or directory, and not a shipped config; "
        f"shipped: {', '.join(shipped())}")


def _parse(text: str, where: str) -> dict[str, Any]:
    """A config.json's object; errors name the file (superoffload/jsonfile.py)."""
    return parse_object(text, where, hint="; a Hugging Face config.json is one JSON object "
                        "such as {\"model_type\": \"llama\", ...}")


def arch_of(cfg: Mapping[str, Any]) -> HFArch:
    """Read one config's shape numbers with its family's defaults (as the transformers config
    classes fill them in), each checked as it is read (plan/config_numbers.py). Errors name
    the key, the unsupported model_type, or the count the planner cannot simulate."""
    return _describe(_reader(cfg))


def _reader(cfg: Mapping[str, Any]) -> ConfigReader:
    return ConfigReader(cfg, f"HF config ({cfg.get('model_type')})")


def _describe(r: ConfigReader) -> HFArch:
    family = str(r.raw("model_type", ""))
    if family not in FAMILIES:
        raise ValueError(
            f"HF config model_type={family!r} has no formula here (formulas: "
            f"{', '.join(FAMILIES)}); with transformers installed ModelShape.from_hf_config "
            "builds it on the meta device (plan/hf_meta.py)")
    named = r.raw("_name_or_path", "")
    if isinstance(named, str) and named:
        name = named
    else:
        # a config saved without its path: the class it names, else the family
        name = (r.names("architectures", []) or [family])[0]
    if family == "gpt2":
        layers_key = "n_layer"
        h, heads = r.whole("n_embd"), r.whole("n_head")
        arch = HFArch(family, name, r.whole(layers_key), h, heads, heads, h // heads,
                      r.whole("n_inner", 4 * h), r.whole("vocab_size"),
                      r.whole("n_positions", 1024), r.flag("tie_word_embeddings", True),
                      True, True, True)
    else:
        layers_key = "num_hidden_layers"
        h, heads = r.whole("hidden_size"), r.whole("num_attention_heads")
        layers, vocab = r.whole(layers_key), r.whole("vocab_size")
        positions = r.whole("max_position_embeddings", 2048)
        tied = r.flag("tie_word_embeddings", False)
        if family == "gpt_neox":
            # GPT-NeoX's attention biases default on (its MLP always has them)
            bias = r.flag("attention_bias", True)
            arch = HFArch(family, name, layers, h, heads, heads, h // heads,
                          r.whole("intermediate_size", 4 * h), vocab, positions, tied,
                          bias, bias, True)
        else:
            kv = r.whole("num_key_value_heads", heads)
            head_dim = r.whole("head_dim", max(1, h // heads))
            attn_bias = r.flag("attention_bias", False)
            qkv_bias = o_bias = attn_bias
            if family == "qwen2":
                # Qwen2 always biases Q, K and V and never O; its config has no key for it
                qkv_bias, o_bias = True, False
            arch = HFArch(family, name, layers, h, heads, kv, head_dim,
                          r.whole("intermediate_size"), vocab, positions, tied,
                          qkv_bias, o_bias, r.flag("mlp_bias", False))
    # what the numbers add up to, before anything is listed per layer (a 1e9-layer config
    # would build a billion-entry list): the simulation's size, then the parameters
    per_block = len(_block(arch, "b"))
    edge = len(parameter_shapes(dataclasses.replace(arch, layers=0)))
    check_counts(arch.layers * per_block + edge, arch.layers,
                 f"{r.where}: {layers_key}={arch.layers:,}")
    check_param_count(parameter_count(arch), r.where)
    return arch


def _linear(prefix: str, out_f: int, in_f: int, bias: bool) -> list[tuple[str, Shape]]:
    """nn.Linear registers weight (out x in) then bias (out)."""
    out: list[tuple[str, Shape]] = [(f"{prefix}.weight", (out_f, in_f))]
    if bias:
        out.append((f"{prefix}.bias", (out_f,)))
    return out


def _norm(prefix: str, h: int, bias: bool) -> list[tuple[str, Shape]]:
    out: list[tuple[str, Shape]] = [(f"{prefix}.weight", (h,))]
    if bias:
        # LayerNorm; RMSNorm has a weight only
        out.append((f"{prefix}.bias", (h,)))
    return out


def _block(a: HFArch, p: str) -> list[tuple[str, Shape]]:
    """One decoder block's parameters in registration order; `p` is its name prefix."""
    h, f = a.hidden, a.ffn
    if a.family == "gpt2":  # Conv1D stores weight as (in, out)
        return [*_norm(f"{p}.ln_1", h, True),
                (f"{p}.attn.c_attn.weight", (h, 3 * h)), (f"{p}.attn.c_attn.bias", (3 * h,)),
                (f"{p}.attn.c_proj.weight", (h, h)), (f"{p}.attn.c_proj.bias", (h,)),
                *_norm(f"{p}.ln_2", h, True),
                (f"{p}.mlp.c_fc.weight", (h, f)), (f"{p}.mlp.c_fc.bias", (f,)),
                (f"{p}.mlp.c_proj.weight", (f, h)), (f"{p}.mlp.c_proj.bias", (h,))]
    if a.family == "gpt_neox":
        return [*_norm(f"{p}.input_layernorm", h, True),
                *_norm(f"{p}.post_attention_layernorm", h, True),
                *_linear(f"{p}.attention.query_key_value", 3 * h, h, a.qkv_bias),
                *_linear(f"{p}.attention.dense", h, h, a.o_bias),
                *_linear(f"{p}.mlp.dense_h_to_4h", f, h, True),
                *_linear(f"{p}.mlp.dense_4h_to_h", h, f, True)]
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return [*_linear(f"{p}.self_attn.q_proj", q, h, a.qkv_bias),
            *_linear(f"{p}.self_attn.k_proj", kv, h, a.qkv_bias),
            *_linear(f"{p}.self_attn.v_proj", kv, h, a.qkv_bias),
            *_linear(f"{p}.self_attn.o_proj", h, q, a.o_bias),
            *_linear(f"{p}.mlp.gate_proj", f, h, a.mlp_bias),
            *_linear(f"{p}.mlp.up_proj", f, h, a.mlp_bias),
            *_linear(f"{p}.mlp.down_proj", h, f, a.mlp_bias),
            *_norm(f"{p}.input_layernorm", h, False),
            *_norm(f"{p}.post_attention_layernorm", h, False)]


def parameter_shapes(arch: HFArch) -> list[tuple[int, str, Shape]]:
    """(layer, name, shape) of every parameter in `named_parameters()` order: layer 0 the
    embeddings, 1..layers the blocks, layers + 1 the final norm and an untied head."""
    a, top = arch, arch.layers + 1
    h, v = a.hidden, a.vocab
    pre: list[tuple[str, Shape]]
    if a.family == "gpt2":
        pre = [("transformer.wte.weight", (v, h)), ("transformer.wpe.weight", (a.positions, h))]
        blocks = "transformer.h"
        post = _norm("transformer.ln_f", h, True)
    elif a.family == "gpt_neox":
        pre, blocks = [("gpt_neox.embed_in.weight", (v, h))], "gpt_neox.layers"
        post = _norm("gpt_neox.final_layer_norm", h, True)
    else:
        pre, blocks = [("model.embed_tokens.weight", (v, h))], "model.layers"
        post = _norm("model.norm", h, False)
    if not a.tied:
        post = [*post, ("lm_head.weight", (v, h))]
    out = [(0, n, s) for n, s in pre]
    for i in range(a.layers):
        out += [(i + 1, n, s) for n, s in _block(a, f"{blocks}.{i}")]
    return out + [(top, n, s) for n, s in post]


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parameter_count(arch: HFArch) -> int:
    """Total parameters (a tied head once), without listing every layer."""
    one = sum(_numel(s) for _, s in _block(arch, "b"))
    edge = sum(_numel(s) for _, _, s in parameter_shapes(dataclasses.replace(arch, layers=0)))
    return arch.layers * one + edge


def _dropout_on(r: ConfigReader) -> bool:
    """Whether the config trains with dropout (then its masks are kept for backward)."""
    # GPT-2 names its dropout resid_pdrop; Llama-style configs only have attention_dropout
    key = "resid_pdrop" if r.raw("resid_pdrop", None) is not None else "attention_dropout"
    return r.fraction(key, 0.0) > 0


def config_keys(config_or_path: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(keys read, keys not read) of a config (see `load_config`): for the shipped families the keys
    the formulas looked up, for any other the architecture's own keys transformers' config
    class takes (plan/hf_meta.config_keys). A key not read changes nothing in the plan."""
    raw = load_config(config_or_path)
    if str(raw.get("model_type", "")) not in FAMILIES:
        from superoffload.plan import hf_meta

        return hf_meta.config_keys(raw)
    rec = _reader(raw)
    _describe(rec)
    _dropout_on(rec)
    keys = [k for k in raw if k != "model_type" and not k.startswith("_")]
    return (tuple(sorted(k for k in keys if k in rec.looked_up)),
            tuple(sorted(k for k in keys if k not in rec.looked_up)))


def shape_fields(config_or_path: Any, *, seq: int | None = None, micro_batch: int = 1,
                 **kw: Any) -> dict[str, Any]:
    """ModelShape's fields for an HF causal LM config (see `load_config` for what `config_or_path`
    may be); ``ModelShape.from_hf_config`` builds the shape from them (this module does not
    import shapes.py: no import cycle). `seq` defaults to the config's context length capped
    at DEFAULT_MAX_SEQ; other keywords (activation_checkpointing, dp, ...) pass through."""
    raw = load_config(config_or_path)
    if str(raw.get("model_type", "")) not in FAMILIES:  # any other architecture: meta device
        from superoffload.plan import hf_meta

        return hf_meta.shape_fields(raw, seq=seq, micro_batch=micro_batch,
                                    max_seq=DEFAULT_MAX_SEQ, **kw)
    reader = _reader(raw)
    arch = _describe(reader)
    table = parameter_shapes(arch)
    block = sum(_numel(s) for layer, _, s in table if layer == 1)
    total = sum(_numel(s) for _, _, s in table)
    if seq is None:
        # the context length, capped: a 128k context is not a default training sequence
        seq = min(arch.positions, DEFAULT_MAX_SEQ)
    fields: dict[str, Any] = dict(
        layers=arch.layers, hidden=arch.hidden, heads=arch.heads, vocab=arch.vocab, seq=seq,
        micro_batch=micro_batch, ffn_hidden=arch.ffn, tied_embeddings=arch.tied,
        learned_positions=arch.family == "gpt2", block_params_override=block,
        other_params_override=total - arch.layers * block, kv_heads=arch.kv_heads,
        head_dim=arch.head_dim, gated_mlp=arch.family in ("llama", "mistral", "qwen2"),
        bias=arch.family in ("gpt2", "gpt_neox"),
        dropout_masks=_dropout_on(reader))
    fields["param_table"] = tuple((layer, _numel(s)) for layer, _, s in table)
    fields.update(kw)
    return fields
