"""DeepSpeed-style dicts convert once into OffloadConfig; bad keys are errors naming them."""

from __future__ import annotations

import pytest
import torch
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import ConfigError

PAPER = {  # the SuperOffload tutorial's shape of a DeepSpeed config
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                              "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.90,
                              "super_offload": True, "cpuadam_cores_perc": 0.90},
    },
}


def test_paper_config_converts():
    config, opt = so.from_deepspeed(PAPER)
    assert (config.ratio, config.pin_memory, config.cpu_cores_frac) == (0.9, True, 0.9)
    assert config.max_grad_norm == 1.0 and config.grad_accum_steps == 2
    assert config.speculation == "on"
    assert opt == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                   "adamw_mode": True}


def test_fp16_sections_and_zero_offload_schedule():
    config, opt = so.from_deepspeed({
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 100, "hysteresis": 3, "min_loss_scale": 0.5},
        "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}},
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": False}},
    })
    assert (config.loss_scale, config.initial_scale_power, config.loss_scale_window,
            config.hysteresis, config.min_loss_scale) == ("dynamic", 12, 100, 3, 0.5)
    assert config.speculation == "off" and opt["adamw_mode"] is False
    static, _ = so.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scale == "none" and static.static_loss_scale == 128.0
    none, _ = so.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "none"}}})
    assert none.ratio == 0.0


@pytest.mark.parametrize(("ds", "key"), [
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratioo": 0.5}}}, "ratioo"),
    ({"gradient_clipping": 1.0, "fp17": {}}, "fp17"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "momentum"),
    ({"optimizer": {"type": "SGD"}}, "optimizer.type"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, "train_batch_size"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "device"),
    ({"zero_optimization": {"offload_optimizer": {"device": "none", "ratio": 0.5}}}, "ratio"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "ratio"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "adam_w_mode"),
    ({"gradient_clipping": 1.0, "superoffload": {"max_grad_norm": 2.0}}, "max_grad_norm"),
    ({"superoffload": {"bucket_byts": 1}}, "bucket_byts"),
])
def test_unknown_or_contradictory_keys_name_the_key(ds, key):
    with pytest.raises(ConfigError, match=key):
        so.from_deepspeed(ds)


def test_initialize_accepts_a_deepspeed_dict_and_checks_precision():
    model = make_model(dtype=torch.bfloat16)
    ds = {**PAPER, "superoffload": {"device": "cpu", "bucket_bytes": 4096, "cpu_threads": 1}}
    with so.initialize(model, config=ds) as engine:
        assert engine.optimizer.param_groups[0]["lr"] == 3e-4
        for x, y in batches(4):
            engine.backward(model(x, y))
            engine.step()
        assert engine.iteration == 2  # 2 accumulation steps per iteration
    with pytest.raises(ConfigError, match="bf16"):
        so.initialize(make_model(), config=ds)


def test_presets_are_valid():
    for preset in (so.presets.tiny_cpu(), so.presets.gh200(), so.presets.pcie_host()):
        assert preset.validate() is preset
    assert so.presets.gh200().bucket_bytes == 64 << 20
