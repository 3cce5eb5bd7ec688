"""DeepSpeed-style dicts convert once into OffloadConfig; bad keys are errors naming them."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from _tiny_models import batches, make_model

import superoffload as so
from superoffload import ds_config, ds_keys
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


# ---------------------------------------------------------------- strict types
_OFF = "zero_optimization.offload_optimizer."


@pytest.mark.parametrize(("ds", "key", "fix"), [
    ({"zero_optimization": {"stage": 99}}, "zero_optimization.stage=99", "use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": "three"}}, "zero_optimization.stage='three'",
     "use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage='3'", "a number"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=True", "use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2.0}}, "zero_optimization.stage=2.0", "use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.stage=0", "set stage 2"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": "false"}}},
     _OFF + "super_offload='false'", "use true or false"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "super_offload": 0}}},
     _OFF + "super_offload=0", "use true or false"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": "true"}}},
     _OFF + "pin_memory='true'", "use true or false"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm='yes'",
     "use true or false"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes'", "use true or false"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled=1", "use true or false"),
    ({"fp16": {"enabled": True, "loss_scale": "128"}}, "fp16.loss_scale='128'", "finite number"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "False"}}},
     "optimizer.params.adam_w_mode='False'", "use true or false"),
    ({"wall_clock_breakdown": "no"}, "wall_clock_breakdown='no'", "use true or false"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0", "whole number >= 1"),
    ({"gradient_accumulation_steps": "2"}, "gradient_accumulation_steps='2'", "whole number"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu=2.5", "whole number"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping=nan", "finite number >= 0"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping='1.0'", "finite number >= 0"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0", "finite number >= 0"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size=1.5",
     "whole number"),
    ({"superoffload": {"precision": "bf16"}}, "superoffload.precision='bf16'", "contradicts"),
])
def test_wrong_types_are_refused_naming_key_and_fix(ds, key, fix):
    with pytest.raises(ConfigError) as info:
        so.from_deepspeed(ds)
    assert key in str(info.value) and fix in str(info.value), str(info.value)


def test_string_false_no_longer_keeps_speculation_on():
    """Before: `super_offload: "false"` is truthy, so speculation silently stayed on."""
    off, _ = so.from_deepspeed({"zero_optimization": {"offload_optimizer": {
        "device": "cpu", "super_offload": False}}})
    on, _ = so.from_deepspeed({"zero_optimization": {"offload_optimizer": {
        "device": "cpu", "super_offload": True}}})
    assert (off.speculation, on.speculation) == ("off", "on")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_one_to_three_are_the_offload_schedule(stage):
    zero = {**PAPER["zero_optimization"], "stage": stage}
    config, _ = so.from_deepspeed({**PAPER, "zero_optimization": zero})
    reference, _ = so.from_deepspeed(PAPER)  # the paper's stage 3
    assert config == reference


def test_stage_zero_means_no_offload_and_big_counts_may_be_floats():
    config, _ = so.from_deepspeed({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8}})
    assert config.ratio == 0.0 and config.bucket_bytes == 2_000_000_000  # 5e8 fp32 elements


@pytest.mark.parametrize(("ds", "precision"), [
    (PAPER, "bf16"),
    ({"fp16": {"enabled": True}}, "fp16"),
    ({"bf16": {"enabled": False}}, "fp32"),
    ({}, "fp32"),
])
def test_precision_is_the_typed_field(ds, precision):
    config, _ = so.from_deepspeed(ds)
    assert config.precision == precision
    assert "deepspeed_precision" not in config.extra  # the typed field replaced it
    same, _ = so.from_deepspeed({**ds, "superoffload": {"precision": precision}})
    assert same.precision == precision  # an agreeing override is no contradiction


# ---------------------------------------------------------------- Trainer JSON
HF_ZERO2 = {  # the ZeRO-2 + CPU offload example of the Hugging Face DeepSpeed guide
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_trainer_zero2_json_is_accepted_and_listed_once():
    with pytest.warns(ds_keys.DeepSpeedNotice) as caught:
        config, opt = so.from_deepspeed(HF_ZERO2)
    assert len(caught) == 1  # said once, at the start
    text = str(caught[0].message)
    for key in ("zero_optimization.allgather_partitions", "zero_optimization.overlap_comm",
                "steps_per_print", "wall_clock_breakdown", "optimizer.params.lr",
                "gradient_clipping"):
        assert key in text, key
    # the dropped scheduler: which schedule runs instead
    assert "scheduler 'WarmupLR' is not run" in text and "lr_scheduler_type" in text
    assert config.bucket_bytes == 8 * 10**8 and config.pin_memory and config.precision == "fp32"
    assert config.max_grad_norm is None and opt == {"adamw_mode": True}  # "auto": defaults
    assert config.extra["deepspeed"]["scheduler"] and "steps_per_print" in \
        config.extra["deepspeed"]["ignored"]


def test_a_path_string_is_read(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO2))
    with pytest.warns(ds_keys.DeepSpeedNotice, match=str(path)):
        from_path, _ = so.from_deepspeed(str(path))
    with pytest.warns(ds_keys.DeepSpeedNotice):
        from_dict, _ = so.from_deepspeed(HF_ZERO2)
    assert from_path.replace(extra={}) == from_dict.replace(extra={})
    assert so.from_deepspeed(path)[0].replace(extra={}) == from_dict.replace(extra={})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json: not valid JSON"):
        so.from_deepspeed(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="cannot read"):
        so.from_deepspeed(tmp_path / "missing.json")


def test_auto_values_come_from_training_arguments():
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           max_grad_norm=1.0, learning_rate=5e-5, adam_beta1=0.9,
                           adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.01, bf16=True,
                           fp16=False)
    with pytest.warns(ds_keys.DeepSpeedNotice, match="optimizer.params.lr=5e-05"):
        config, opt = so.from_deepspeed(HF_ZERO2, auto=ds_keys.auto_values(args))
    assert config.max_grad_norm == 1.0 and config.grad_accum_steps == 2
    assert opt == {"lr": 5e-5, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.01,
                   "adamw_mode": True}


@pytest.mark.parametrize(("section", "key"), [
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"sparse_gradients": True}, "sparse_gradients"),  # flags, not sections, are refused too
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads"),
])
def test_keys_that_change_results_are_refused_by_name(section, key):
    with pytest.raises(ConfigError, match=f"DeepSpeed key {key} would change"):
        so.from_deepspeed(section)


def test_initialize_takes_trainer_json():
    model = make_model()
    zero = {**HF_ZERO2["zero_optimization"], "reduce_bucket_size": 1024,
            "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    ds = {**HF_ZERO2, "zero_optimization": zero, "superoffload": {"device": "cpu",
                                                                  "cpu_threads": 1}}
    with pytest.warns(ds_keys.DeepSpeedNotice), so.initialize(
            model, optimizer={"lr": 1e-3}, config=ds) as engine:
        for x, y in batches(2):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        assert engine.iteration == 2 and engine.config.bucket_bytes == 4096


def test_absent_keys_keep_deepspeeds_meaning_or_are_said_one_line_each():
    """DeepSpeed's defaults (its offload config's): ratio 1.0 and cpuadam_cores_perc 0.8 when
    absent; where this engine keeps its own default instead, the notice says so, one line per
    key (ds_config.DIFFERENCES)."""
    bare = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.warns(ds_keys.DeepSpeedNotice) as caught:
        config, _ = so.from_deepspeed(bare)
    assert (config.ratio, config.cpu_cores_frac) == (1.0, 0.8)
    text = str(caught[0].message)
    for key, why in ds_config.DIFFERENCES.items():
        assert f"{key} {why}" in text, key
    assert config.extra["deepspeed"]["defaults"] == [f"{k} {w}" for k, w in
                                                     ds_config.DIFFERENCES.items()]
    # every key given: nothing differs, nothing to say
    full = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "offload_optimizer": {
        "device": "cpu", "pin_memory": False, "super_offload": False}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, _ = so.from_deepspeed(full)
    assert (config.ratio, config.speculation, config.pin_memory) == (1.0, "off", False)
    # the superoffload section may set what DeepSpeed leaves out, without a contradiction
    ours, _ = so.from_deepspeed({**full, "superoffload": {"ratio": 0.5}})
    assert ours.ratio == 0.5
    # no optimizer offload: ratio 0 as before, and no DeepSpeed offload defaults to state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        none, _ = so.from_deepspeed({"zero_optimization": {"stage": 2}})
    assert none.ratio == 0.0
