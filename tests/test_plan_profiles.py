"""Hardware profiles validate, cite sources, and reject bad figures; ModelShape formulas by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from superoffload import plan
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.plan.hardware import HardwareProfile

REQUIRED_POSITIVE = (
    "device_peak_tflops", "device_achieved_tflops", "device_memory_bytes", "device_mem_bw_gbps",
    "host_memory_bytes", "host_mem_bw_gbps", "cpu_cores", "cpu_adam_params_per_s_per_core",
    "h2d_gbps", "d2h_gbps", "device_cast_gelems", "host_cast_gelems",
)


@pytest.mark.parametrize("name", ["gh200", "gb200", "mi300a", "h100-pcie", "h200-pcie",
                                  "cpu-laptop"])
def test_presets_validate_and_cite(name: str) -> None:
    prof = plan.profiles.get(name)
    assert prof.validate() is prof
    for field in REQUIRED_POSITIVE:
        value = getattr(prof, field)
        assert math.isfinite(value) and value > 0, field
    assert prof.device_achieved_tflops <= prof.device_peak_tflops
    cited = dict(prof.sources)
    for field in REQUIRED_POSITIVE:
        if field in ("host_memory_bytes",) and prof.shared_memory:
            continue
        assert field in cited or field in ("cpu_cores",), f"{name}.{field} has no source"


def test_gh200_figures_are_the_facts() -> None:
    prof = plan.profiles.get("GH200")  # case-insensitive
    # FACTS.md: published measurements of C2C, 375 GB/s host-to-device and 297 back (the spec
    # is 450 each way), marked measured
    assert (prof.h2d_gbps, prof.d2h_gbps) == (375.0, 297.0)
    assert prof.provenance("h2d_gbps") == prof.provenance("d2h_gbps") == "measured"
    assert "450" in prof.source("h2d_gbps")
    assert prof.device_peak_tflops == 989.0
    assert prof.host_memory_bytes == 480e9 and prof.cpu_cores == 72
    assert not prof.is_estimate("h2d_gbps")
    assert prof.is_estimate("link_latency_s")


def test_unknown_profile_lists_names() -> None:
    with pytest.raises(ValueError, match="gh200.*gb200.*mi300a.*h100-pcie.*h200-pcie.*cpu-laptop"):
        plan.profiles.get("tpu-v9")
    assert plan.profiles.names() == list(plan.profiles.NAMES)


@pytest.mark.parametrize("field, value", [("h2d_gbps", -1.0), ("cpu_cores", 0),
                                          ("device_achieved_tflops", 2000.0),
                                          ("host_cast_gelems", float("nan"))])
def test_bad_figures_are_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        plan.profiles.get("gh200").replace(**{field: value})


def test_round_trip_and_unknown_keys() -> None:
    prof = plan.profiles.get("h100-pcie").replace(h2d_table=((1e6, 10.0), (1e8, 50.0)))
    back = HardwareProfile.from_dict(prof.to_dict())
    assert back == prof
    with pytest.raises(ValueError, match="nonsense"):
        HardwareProfile.from_dict({**prof.to_dict(), "nonsense": 1})


TINY = plan.ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq=8, micro_batch=2)


def test_shape_parameter_and_flop_counts_by_hand() -> None:
    # block: attention 4h^2+4h = 16640, MLP 2hf+f+h = 33088 (f = 256), two LayerNorms 4h = 256
    assert TINY.block_params == 49984
    assert TINY.embedding_params == 6400 and TINY.head_params == 128  # tied head: final norm only
    assert TINY.params == 2 * 49984 + 6400 + 128
    # forward per block: tokens * (2 * params + 4 * seq * hidden) = 16 * (99968 + 2048)
    assert TINY.layer_forward_flops() == [0.0, 1632256.0, 1632256.0, 16 * 2 * 100 * 64]
    fwd = 2 * 1632256 + 204800
    assert TINY.model_flops == 3 * fwd
    assert TINY.executed_flops == 3 * fwd + 2 * 1632256  # + block recompute (checkpointing)
    assert TINY.replace(activation_checkpointing=False).executed_flops == 3 * fwd


def test_activation_bytes_by_hand() -> None:
    # what autograd keeps (plan/formulas.py), with checkpointing: the token ids (int64) and
    # the embedding's dropout mask (8 + h per token), each block's input (2h), the head's
    # norm and head inputs, the norm's fp32 mean and rstd, the fp32 log-softmax and the
    # targets (4h + 8 + 4V + 8)
    t, h, v = 16, 64, 100
    assert TINY.layer_activation_bytes() == [t * (8 + h), 2 * t * h, 2 * t * h,
                                             t * (4 * h + 16 + 4 * v)]
    # one block, recomputed during its backward: Korthikanti's 34h (flash attention) + the
    # fp32 log-sum-exp (4 B x 4 heads) + two LayerNorms' mean and rstd (2 x 8 B)
    block = t * (34 * h + 4 * 4 + 2 * 8)
    assert TINY.recompute_bytes() == block
    assert TINY.loss_transient_bytes() == t * 8 * v  # two fp32 gradients of the logits
    assert TINY.activation_bytes() == sum(TINY.layer_activation_bytes()) + max(block, t * 8 * v)
    no_flash = TINY.replace(activation_checkpointing=False, flash_attention=False)
    per_block = t * (34 * h + 5 * 4 * 8 + 2 * 8)  # softmax 2as + mask and output 3as, no lse
    assert no_flash.recompute_bytes() == 0
    assert no_flash.activation_bytes() == pytest.approx(
        2 * per_block + t * (8 + h) + t * (4 * h + 16 + 4 * v) + t * 8 * v)


def test_shape_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="heads"):
        plan.ModelShape(layers=2, hidden=64, heads=5, vocab=100, seq=8)
    with pytest.raises(ValueError, match="layers"):
        plan.ModelShape(layers=0, hidden=64, heads=4, vocab=100, seq=8)
    with pytest.raises(TypeError):
        plan.ModelShape.from_module("not a module", seq=8)


def test_from_module_counts_a_real_gpt() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    shape = plan.ModelShape.from_module(model, seq=32, micro_batch=2)
    assert shape.params == model.num_params()  # the tied head counted once
    assert (shape.layers, shape.hidden, shape.heads, shape.vocab) == (2, 64, 2, 256)
    assert sum(shape.layer_params()) == shape.params
    assert dataclasses.replace(shape, seq=64).params == shape.params
