"""`ModelShape.from_hf_config` (plan/hf_config.py) against models instantiated from the same
config (small configs, every family), and the shipped large configs against their published
parameter counts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from superoffload.plan import ModelShape, hf_config

# Exact totals as the model cards' safetensors metadata / papers give them (tied head once).
PUBLISHED = {
    "gpt2": 124_439_808,            # openai-community/gpt2 ("124M")
    "gpt2-xl": 1_557_611_200,       # openai-community/gpt2-xl ("1.5B")
    "pythia-6.9b": 6_857_302_016,   # Biderman et al. 2023, Pythia, Table 1 (total params)
    "llama-2-7b": 6_738_415_616,    # meta-llama/Llama-2-7b-hf ("6.74B params")
    "llama-2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf ("13B")
    "llama-3-8b": 8_030_261_248,    # meta-llama/Meta-Llama-3-8B ("8.03B params")
    "llama-3.1-70b": 70_553_706_496,  # meta-llama/Llama-3.1-70B ("70.6B params")
    "mistral-7b": 7_241_732_096,    # mistralai/Mistral-7B-v0.1 ("7.24B params")
    "qwen2.5-0.5b": 494_032_768,    # Qwen/Qwen2.5-0.5B ("0.49B"; tied embeddings)
    "qwen2.5-7b": 7_615_616_512,    # Qwen/Qwen2.5-7B ("7.61B")
    "qwen2.5-14b": 14_770_033_664,  # Qwen/Qwen2.5-14B ("14.7B")
    # read on the meta device through transformers (plan/hf_meta.py)
    "gemma-2-9b": 9_241_705_984,    # google/gemma-2-9b ("9.24B")
    "falcon-7b": 6_921_720_704,     # tiiuae/falcon-7b ("6.92B")
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1 ("46.7B")
    "phi-3-mini-4k": 3_821_079_552,  # microsoft/Phi-3-mini-4k-instruct ("3.82B")
}
META = {"gemma-2-9b", "falcon-7b", "mixtral-8x7b", "phi-3-mini-4k"}

# Small variants of the shipped configs, plus the switches each family has.
SMALL = {
    "llama-2-7b": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=97),
    "llama-3-8b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=128,
                       attention_bias=True, mlp_bias=True, head_dim=12),
    "mistral-7b": dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=100),
    "qwen2.5-0.5b": dict(hidden_size=56, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=7, num_key_value_heads=1, vocab_size=90),
    "qwen2.5-14b": dict(hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                        num_attention_heads=5, num_key_value_heads=1, vocab_size=90),
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=40, vocab_size=77),
    "gpt2-xl": dict(n_embd=40, n_head=5, n_layer=2, n_positions=24, vocab_size=50,
                    n_inner=72, tie_word_embeddings=False),
    "pythia-6.9b": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, vocab_size=64, max_position_embeddings=64),
}


def small(name: str) -> dict[str, Any]:
    return {**hf_config.load_config(name), **SMALL[name]}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_match_published_parameter_counts(name):
    if name in META:
        pytest.importorskip("transformers", reason="needs the 'hf' extra")
    shape = ModelShape.from_hf_config(name, seq=4096)
    assert shape.params == PUBLISHED[name]
    if name not in META:
        arch = hf_config.arch_of(hf_config.load_config(name))
        assert hf_config.parameter_count(arch) == PUBLISHED[name]


def test_every_shipped_config_is_covered():
    assert sorted(PUBLISHED) == hf_config.shipped()
    assert any("7b" in n for n in PUBLISHED) and any("14b" in n for n in PUBLISHED)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_parameters_match_the_instantiated_model(name):
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    cfg = small(name)
    fields = {k: v for k, v in cfg.items() if not k.startswith("_")}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**fields))
    want = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied head once
    arch = hf_config.arch_of(cfg)
    got = [(n, s) for _, n, s in hf_config.parameter_shapes(arch)]
    assert got == want  # names, shapes and registration order (the engine's bucket order)
    shape = ModelShape.from_hf_config(cfg, seq=16)
    total = sum(p.numel() for p in model.parameters())
    assert shape.params == total == hf_config.parameter_count(arch)
    layers = model.config.num_hidden_layers
    block = sum(p.numel() for n, p in model.named_parameters() if f".{layers - 1}." in n)
    assert shape.block_params == block
    assert shape.tied_embeddings == bool(model.config.tie_word_embeddings)


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - META))
def test_defaults_agree_with_transformers_config_classes(name):
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    raw = hf_config.load_config(name)
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(**fields)
    # our family defaults (raw JSON) read the same numbers as the filled-in config object
    ours, theirs = hf_config.arch_of(raw), hf_config.arch_of(hf_config.load_config(config))
    assert (ours.layers, ours.hidden, ours.heads, ours.kv_heads, ours.head_dim, ours.ffn,
            ours.vocab, ours.tied, ours.qkv_bias, ours.o_bias, ours.mlp_bias) == (
        theirs.layers, theirs.hidden, theirs.heads, theirs.kv_heads, theirs.head_dim, theirs.ffn,
        theirs.vocab, theirs.tied, theirs.qkv_bias, theirs.o_bias, theirs.mlp_bias)


def test_gqa_swiglu_and_tied_head_in_the_shape():
    shape = ModelShape.from_hf_config("llama-3-8b", seq=2048, micro_batch=2)
    h, f, kv = 4096, 14336, 8 * 128
    assert shape.block_params == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # GQA + SwiGLU
    assert shape.other_params_override == 2 * 128256 * h + h  # untied: embedding + head + norm
    assert (shape.seq, shape.micro_batch, shape.ffn, shape.heads) == (2048, 2, f, 32)
    tied = ModelShape.from_hf_config("qwen2.5-0.5b")
    assert tied.tied_embeddings and tied.other_params_override == 151936 * 896 + 896
    assert tied.seq == hf_config.DEFAULT_MAX_SEQ  # context 32768, capped
    assert (ModelShape.from_hf_config("gpt2").seq == 1024
            and ModelShape.from_hf_config("gpt2").learned_positions)


def test_param_table_when_the_planner_has_one():
    shape = ModelShape.from_hf_config("mistral-7b")
    if "param_table" not in ModelShape.__dataclass_fields__:
        pytest.skip("ModelShape has no param_table in this tree")
    table = shape.param_table
    assert table is not None and sum(n for _, n in table) == shape.params
    assert sum(n for layer, n in table if layer == 1) == shape.block_params
    assert len(table) == 1 + 32 * 9 + 2


def test_config_sources(tmp_path):
    raw = hf_config.load_config("gpt2")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = ModelShape.from_hf_config("gpt2")
    assert ModelShape.from_hf_config(tmp_path) == want  # a directory
    assert ModelShape.from_hf_config(tmp_path / "config.json") == want
    assert ModelShape.from_hf_config(str(tmp_path / "config.json")) == want
    assert ModelShape.from_hf_config(raw) == want
    transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
    assert ModelShape.from_hf_config(transformers.GPT2Config(**raw)) == want


def test_errors_name_the_problem():
    with pytest.raises(FileNotFoundError, match="shipped: .*llama-2-7b"):
        ModelShape.from_hf_config("llama-9000")
    with pytest.raises(ValueError, match="model_type='t5'"):
        ModelShape.from_hf_config({"model_type": "t5"})
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        ModelShape.from_hf_config({"model_type": "llama", "num_attention_heads": 4})
    with pytest.raises(TypeError, match="shipped name"):
        ModelShape.from_hf_config(42)
