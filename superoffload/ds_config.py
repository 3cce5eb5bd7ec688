"""DeepSpeed-style config dicts -> (OffloadConfig, optimizer kwargs), converted once at the edge.

Accepted (DeepSpeed's names and meanings, docs: deepspeed.ai/docs/config-json):
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``
(checked: micro x accumulation, one process), ``gradient_clipping``,
``bf16``/``fp16`` (``enabled``, ``loss_scale`` (0 = dynamic), ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``), ``optimizer`` (``type`` Adam/AdamW,
``params``), ``zero_optimization`` (``stage``, ``reduce_bucket_size``, ``offload_optimizer``
with ``device``, ``pin_memory``, ``ratio``, ``super_offload``, ``cpuadam_cores_perc``), a few
logging keys that do not affect training, and a ``superoffload`` section holding any
OffloadConfig field. Anything else, or a contradiction, is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from superoffload.config import ConfigError, OffloadConfig

_TOP = {
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
    "gradient_clipping", "bf16", "fp16", "optimizer", "zero_optimization", "superoffload",
    "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
}
_ZERO = {"stage", "offload_optimizer", "reduce_bucket_size", "overlap_comm", "contiguous_gradients"}
_OFFLOAD = {"device", "pin_memory", "ratio", "super_offload", "cpuadam_cores_perc", "buffer_count"}
_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
         "min_loss_scale", "auto_cast"}
_BF16 = {"enabled"}
_OPT_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam"}


def _section(d: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}{key}: expected a dict, got {type(value).__name__}")
    return dict(value)


def _unknown(d: Mapping[str, Any], known: set[str], path: str) -> None:
    for key in d:
        if key not in known:
            raise ConfigError(
                f"unknown DeepSpeed key {path}{key!r}; supported here: {', '.join(sorted(known))}"
            )


def from_deepspeed(ds: Mapping[str, Any]) -> tuple[OffloadConfig, dict[str, Any]]:
    """Convert a DeepSpeed config dict; returns (validated OffloadConfig, optimizer kwargs)."""
    if not isinstance(ds, Mapping):
        raise ConfigError(f"DeepSpeed config: expected a dict, got {type(ds).__name__}")
    _unknown(ds, _TOP, "")
    fields: dict[str, Any] = {}

    gas = ds.get("gradient_accumulation_steps", 1)
    fields["grad_accum_steps"] = gas
    micro, total = ds.get("train_micro_batch_size_per_gpu"), ds.get("train_batch_size")
    if micro is not None and total is not None and total != micro * gas:
        raise ConfigError(
            f"train_batch_size={total} contradicts train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={gas} (one process); drop one of them"
        )
    clip = ds.get("gradient_clipping", 0.0)
    fields["max_grad_norm"] = clip if clip else None

    fp16, bf16 = _section(ds, "fp16", ""), _section(ds, "bf16", "")
    _unknown(fp16, _FP16, "fp16.")
    _unknown(bf16, _BF16, "bf16.")
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one precision")
    precision = "fp16" if fp16.get("enabled") else "bf16" if bf16.get("enabled") else "fp32"
    if fp16.get("enabled"):
        scale = fp16.get("loss_scale", 0)
        if scale:
            fields.update(loss_scale="none", static_loss_scale=float(scale))
        else:
            fields["loss_scale"] = "dynamic"
        for ds_key, ours in (("initial_scale_power", "initial_scale_power"),
                             ("loss_scale_window", "loss_scale_window"),
                             ("hysteresis", "hysteresis"), ("min_loss_scale", "min_loss_scale")):
            if ds_key in fp16:
                fields[ours] = fp16[ds_key]

    zero = _section(ds, "zero_optimization", "")
    _unknown(zero, _ZERO, "zero_optimization.")
    if "reduce_bucket_size" in zero:
        fields["bucket_bytes"] = int(zero["reduce_bucket_size"]) * 4  # elements -> fp32 bytes
    off = _section(zero, "offload_optimizer", "zero_optimization.")
    _unknown(off, _OFFLOAD, "zero_optimization.offload_optimizer.")
    device = off.get("device", "cpu" if off else "none")
    if device not in ("cpu", "none"):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device={device!r}: use 'cpu' (or 'none'); "
            "NVMe offload is not supported"
        )
    if device == "none":
        if off.get("ratio", 0.0):
            raise ConfigError(
                "zero_optimization.offload_optimizer.ratio > 0 contradicts device='none'"
            )
        fields["ratio"] = 0.0
    elif "ratio" in off:
        fields["ratio"] = off["ratio"]
    if "pin_memory" in off:
        fields["pin_memory"] = off["pin_memory"]
    if "cpuadam_cores_perc" in off:
        fields["cpu_cores_frac"] = off["cpuadam_cores_perc"]
    if off.get("super_offload") is False:
        fields["speculation"] = "off"  # ZeRO-Offload schedule: step after validation

    overrides = _section(ds, "superoffload", "")
    names = {f.name for f in dataclasses.fields(OffloadConfig)}
    _unknown(overrides, names, "superoffload.")
    for key, value in overrides.items():
        if key in fields and fields[key] != value:
            raise ConfigError(
                f"superoffload.{key}={value!r} contradicts the DeepSpeed setting that gives {fields[key]!r}"
            )
    fields.update(overrides)
    fields["extra"] = {**fields.get("extra", {}), "deepspeed_precision": precision}
    if micro is not None:
        fields["extra"]["train_micro_batch_size_per_gpu"] = micro
    try:
        config = OffloadConfig(**fields).validate()
    except TypeError as exc:  # a wrong type that the dataclass constructor rejects
        raise ConfigError(f"DeepSpeed config: {exc}") from exc
    return config, _optimizer(ds)


def _optimizer(ds: Mapping[str, Any]) -> dict[str, Any]:
    opt = _section(ds, "optimizer", "")
    _unknown(opt, {"type", "params"}, "optimizer.")
    kind = str(opt.get("type", "AdamW"))
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type={kind!r}: the engine runs Adam/AdamW; use one of them")
    params = _section(opt, "params", "optimizer.")
    _unknown(params, _OPT_PARAMS, "optimizer.params.")
    out: dict[str, Any] = {}
    for key in ("lr", "eps", "weight_decay", "bias_correction"):
        if key in params:
            out[key] = params[key]
    if "betas" in params:
        out["betas"] = tuple(params["betas"])
    # DeepSpeed: "AdamW" is decoupled decay; "Adam" follows adam_w_mode, default True.
    adamw = True if kind.lower() == "adamw" else bool(params.get("adam_w_mode", True))
    if kind.lower() == "adamw" and params.get("adam_w_mode") is False:
        raise ConfigError("optimizer.params.adam_w_mode=false contradicts optimizer.type='AdamW'")
    out["adamw_mode"] = adamw
    return out
