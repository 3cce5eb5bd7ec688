"""Any Hugging Face architecture: built on the meta device, MoE total vs
active, and the FLOP formulas for GQA, SwiGLU, MoE and wide heads checked against
``torch.utils.flop_counter.FlopCounterMode`` on small instantiated models."""

from __future__ import annotations

import json

import pytest
import torch

from superoffload import cli
from superoffload.plan import ModelShape, hf_config

transformers = pytest.importorskip("transformers", reason="needs the 'hf' extra")
FlopCounterMode = pytest.importorskip("torch.utils.flop_counter").FlopCounterMode

# small variants of shipped configs: GQA + SwiGLU (llama), MoE (mixtral), head_dim != h/heads
# (gemma2), fused gate_up + qkv (phi3), multi-query + parallel attention (falcon), GPT-2
SMALL = {
    "llama-3-8b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=128,
                       bos_token_id=1, eos_token_id=2),
    "mixtral-8x7b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                         num_local_experts=4, num_experts_per_tok=2),
    "gemma-2-9b": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=90,
                       sliding_window=8),
    "phi-3-mini-4k": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                          sliding_window=None, pad_token_id=0, eos_token_id=1),
    "falcon-7b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100),
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=40, vocab_size=77),
}
FLOP_TOLERANCE = 0.03
"""Our count treats norm weights and biases as matmul parameters (2 FLOPs each per token);
the counter sees only matmuls. 0.2-0.8% on these models, 2.9% on GPT-2 at width 32 (biases)."""


def _model(name: str) -> torch.nn.Module:
    raw = {**hf_config.load_config(name), **SMALL[name]}
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    cfg = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    # eager attention and experts: the counter sees their matmuls (the fused CPU kernels,
    # flash attention and grouped experts, are not in FlopCounterMode's table)
    kwargs = {"attn_implementation": "eager"}
    if getattr(cfg, "num_local_experts", None):
        kwargs["experts_implementation"] = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg, **kwargs).float()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_flops_match_the_flop_counter(name):
    model = _model(name)
    batch, seq = 2, 16
    x = torch.randint(0, model.config.vocab_size, (batch, seq))
    shape = ModelShape.from_module(model, seq=seq, micro_batch=batch,
                                   activation_checkpointing=False)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x)
    counted = counter.get_total_flops()
    ours = sum(shape.layer_forward_flops())
    assert ours == pytest.approx(counted, rel=FLOP_TOLERANCE), (name, ours, counted)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x).loss.backward()
    assert shape.executed_flops == pytest.approx(counter.get_total_flops(), rel=FLOP_TOLERANCE)


def test_moe_reports_total_and_active_parameters():
    shape = ModelShape.from_hf_config("mixtral-8x7b", seq=4096)
    # 8 experts of 3 x 4096 x 14336 per layer, 2 active: 6 x 3 x 4096 x 14336 idle per layer
    idle = 32 * 6 * 3 * 4096 * 14336
    assert shape.params == 46_702_792_704 and shape.active_params == shape.params - idle
    assert (shape.experts, shape.experts_per_token) == (8, 2)
    # timed on the active parameters: ~3.6x fewer FLOPs than a dense model of the same size
    dense = shape.replace(active_block_params_override=None, experts=0, experts_per_token=0)
    assert shape.model_flops < dense.model_flops / 3.3
    small = ModelShape.from_module(_model("mixtral-8x7b"), seq=16)
    assert small.active_params < small.params and small.experts == 4
    # the same MoE from numbers: transformers' fused experts, parameter by parameter
    numbers = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96,
                         gated_mlp=True, bias=False, dropout_masks=False, vocab=100, seq=16,
                         experts=4, experts_per_token=2, tied_embeddings=False)
    assert [n for _, n in small.param_table] == numbers.param_layout()[1].tolist()
    assert (numbers.params, numbers.active_params) == (small.params, small.active_params)


def test_gqa_swiglu_shape_from_numbers_matches_the_model():
    model = _model("llama-3-8b")
    numbers = ModelShape(layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=96, gated_mlp=True,
                         bias=False, dropout_masks=False, vocab=128, tied_embeddings=False,
                         seq=16, micro_batch=2, activation_checkpointing=False)
    read = ModelShape.from_module(model, seq=16, micro_batch=2, activation_checkpointing=False)
    assert numbers.params == read.params == sum(p.numel() for p in model.parameters())
    assert numbers.block_params == read.block_params
    assert [n for _, n in read.param_table] == list(numbers.param_layout()[1])
    assert numbers.layer_forward_flops() == pytest.approx(read.layer_forward_flops())


def test_activation_formula_by_hand():
    # GPT: Korthikanti et al. 34 sbh per block (flash attention) + the fp32 log-sum-exp (4a)
    # + two LayerNorms' fp32 mean and rstd; outside the blocks the token ids and embedding
    # dropout mask, and the head's inputs, norm statistics, fp32 log-softmax and targets
    gpt = ModelShape(layers=1, hidden=64, heads=4, vocab=10, seq=8, activation_checkpointing=False)
    assert gpt.layer_activation_bytes() == [8 * (8 + 64), 8 * (34 * 64 + 4 * 4 + 2 * 8),
                                            8 * (4 * 64 + 8 + 4 * 10 + 8)]
    # GQA + SwiGLU, no dropout: norms 4h + two RMSNorm rstd (4 B), attention 2h + 4q + 4kv
    # + 4a, MLP 2h + 8f
    h, q, kv, f = 64, 64, 16, 96
    llama = gpt.replace(kv_heads=1, gated_mlp=True, ffn_hidden=f, bias=False, dropout_masks=False)
    assert llama.layer_activation_bytes()[1] == 8 * (4 * h + 2 * 4 + 2 * h + 4 * q + 4 * kv
                                                     + 4 * 4 + 2 * h + 8 * f)
    # MoE, 1 of 4 experts per token: that expert's MLP activations + 4E fp32 router bytes
    moe = llama.replace(experts=4, experts_per_token=1)
    assert moe.layer_activation_bytes()[1] == 8 * (4 * h + 2 * 4 + 2 * h + 4 * q + 4 * kv
                                                   + 4 * 4 + 1 * (2 * h + 8 * f) + 4 * 4)
    # head_dim wider than hidden / heads (Gemma-2): attention FLOPs use heads x head_dim
    wide = gpt.replace(head_dim=32)
    assert wide.layer_forward_flops()[1] - 2 * 8 * wide.active_block_params == 8 * 4 * 8 * 128


def test_training_dtype_is_not_the_configs(capsys):
    raw = hf_config.load_config("gemma-2-9b")
    assert raw["torch_dtype"] == "float32"
    assert ModelShape.from_hf_config(raw).dtype == "bfloat16"
    assert ModelShape.from_hf_config(raw, dtype="float16").dtype == "float16"
    assert cli.main(["plan", "--hf-config", "gemma-2-9b", "--profile", "h200-pcie-measured",
                     "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["dtype"] == "float32" and out["model"]["family"] == "gemma2"


def test_remote_code_is_never_run():
    # a type transformers ships is planned as data, its auto_map dropped (nothing imported)
    falcon = hf_config.load_config("falcon-7b")
    named = {**falcon, "auto_map": {"AutoModelForCausalLM": "x.Y"}}
    assert ModelShape.from_hf_config(named) == ModelShape.from_hf_config(falcon)
    # a type only its own code describes is refused
    with pytest.raises(ValueError, match="never runs code from a config"):
        ModelShape.from_hf_config({**named, "model_type": "falcon_custom"})
