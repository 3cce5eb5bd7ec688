"""DeepSpeed-style config dicts -> (OffloadConfig, optimizer kwargs), converted once at the edge.

A dict or a JSON file path. Trainer-style JSON (``"auto"`` values, communication buckets,
logging keys, a ``scheduler`` section) is prepared by superoffload/ds_keys.py: what does not
change one process's results is accepted and listed once, what would is refused by name.
Converted (DeepSpeed's names and meanings, docs: deepspeed.ai/docs/config-json):
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``
(checked: micro x accumulation, one process), ``gradient_clipping``,
``bf16``/``fp16`` (``enabled``, ``loss_scale`` (0 = dynamic), ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``), ``optimizer`` (``type`` Adam/AdamW,
``params``), ``zero_optimization`` (``stage``, ``reduce_bucket_size``, ``offload_optimizer``
with ``device``, ``pin_memory``, ``ratio``, ``super_offload``, ``cpuadam_cores_perc``,
``offload_param``: weight-flow, ``_offload_param``), a few
logging keys that do not affect training, and a ``superoffload`` section holding any
OffloadConfig field. Anything else, or a contradiction, is a ``ConfigError`` naming the key.

``zero_optimization.stage`` takes DeepSpeed's values 0-3 and means, for this engine:

- 0: no ZeRO partitioning; only valid without optimizer offload (``offload_optimizer``
  absent or ``device: "none"``: every bucket is stepped on the device, ratio 0), as in
  DeepSpeed, whose optimizer offload needs stage >= 1;
- 1, 2, 3: the offload schedule. One process keeps the whole fp32 optimizer state on the
  host; under data parallel (``distributed.fsdp.FsdpOffloadEngine``) gradients are
  reduce-scattered and each rank keeps and steps its shard of the optimizer state, i.e.
  ZeRO stage 2 for 1 and 2. Stage 3 (the SuperOffload tutorial's setting) is accepted with
  the same meaning: the engine does not partition the bf16 weights across ranks; to keep
  weights off the device, use weight-flow (``superoffload: {"weights": "flow"}``).

The precision (``bf16.enabled`` / ``fp16.enabled``, else fp32) becomes
``OffloadConfig.precision``, which the engine checks against the model's parameters.

A key left out keeps DeepSpeed's default (its offload config's defaults):
``offload_optimizer.ratio`` absent is 1.0 (every parameter's state on the CPU) and
``cpuadam_cores_perc`` 0.8. Where this engine keeps its own default instead, the conversion
says so, one line per key, in its notice (``DIFFERENCES``): a missing ``super_offload``
(DeepSpeed: off) keeps speculation on, a missing ``pin_memory`` (DeepSpeed: false) pins the
host buffers, a missing ``reduce_bucket_size`` (DeepSpeed: 5e8 elements) keeps 64 MiB
buckets (paper §4.2).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

from superoffload import ds_keys
from superoffload.config import ConfigError, OffloadConfig

_TOP = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
        "gradient_clipping", "bf16", "fp16", "optimizer", "zero_optimization", "superoffload",
        "aio"}
_ZERO = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size"}
_PARAM = {"device", "nvme_path", "buffer_count", "pin_memory"}
_OFFLOAD = {"device", "pin_memory", "ratio", "super_offload", "cpuadam_cores_perc", "nvme_path",
            "buffer_count"}
_AIO = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "use_gds"}
AIO_FIELDS = {"block_size": "storage_block_bytes", "queue_depth": "storage_queue_depth",
              "thread_count": "storage_threads", "intra_op_parallelism": "storage_threads"}
"""DeepSpeed's ``aio`` keys and the OffloadConfig field each sets (the same meaning: bytes
per request, requests in flight, parallel submitting threads; ``intra_op_parallelism`` is
the newer name of ``thread_count``)."""
AIO_STATES_PER_BUFFER = 4
"""DeepSpeed's ``offload_optimizer.buffer_count`` counts buffers of one state tensor each
(Adam: parameter, gradient, both moments); a buffer of ours holds a whole bucket's four."""
_FP16 = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
         "min_loss_scale", "auto_cast"}
_BF16 = {"enabled"}
_OPT_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam"}
ACCEPTED_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(_TOP), "zero_optimization": frozenset(_ZERO),
    "zero_optimization.offload_optimizer": frozenset(_OFFLOAD), "fp16": frozenset(_FP16),
    "zero_optimization.offload_param": frozenset(_PARAM),
    "bf16": frozenset(_BF16), "optimizer.params": frozenset(_OPT_PARAMS),
    "aio": frozenset(_AIO)}
"""Every DeepSpeed key ``from_deepspeed`` reads, by section ("" = the top level): the
surface test (tests/test_surface.py) freezes it."""
DEEPSPEED_DEFAULTS = {"ratio": 1.0, "cpu_cores_frac": 0.8}
"""OffloadConfig fields a DeepSpeed dict that offloads sets to DeepSpeed's default when its
key is absent (``offload_optimizer.ratio`` 1.0, ``cpuadam_cores_perc`` 0.8)."""
DIFFERENCES = {
    "zero_optimization.offload_optimizer.super_offload":
        "absent: DeepSpeed steps the CPU after validation (no SuperOffload); here speculation "
        "stays on (set super_offload: false for DeepSpeed's schedule)",
    "zero_optimization.offload_optimizer.pin_memory":
        "absent: DeepSpeed does not pin host buffers; here they are pinned (set pin_memory: "
        "false to match)",
    "zero_optimization.reduce_bucket_size":
        "absent: DeepSpeed's reduce buckets hold 5e8 elements; here buckets are 64 MiB of fp32 "
        "gradient (set reduce_bucket_size to match)"}
"""Keys whose absence this engine reads differently from DeepSpeed: one line each."""
STAGES = (0, 1, 2, 3)
"""``zero_optimization.stage`` values accepted (their meaning: the module docstring)."""


def _section(d: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}{key}: expected a dict, got {type(value).__name__}")
    return dict(value)


def _bool(d: Mapping[str, Any], key: str, path: str, default: bool = False) -> bool:
    """A JSON boolean; a string such as "false" (truthy in Python) is refused."""
    value = d.get(key, default)
    # types are strict, as JSON gives them: "false" would silently keep speculation on
    if not isinstance(value, bool):
        raise ConfigError(f"{path}{key}={value!r} is a {type(value).__name__}: use true or "
                          "false (a JSON boolean, not a string or a number)")
    return value


def _int(d: Mapping[str, Any], key: str, path: str, *, low: int) -> int:
    """A whole number >= low (an integral float such as 5e8 is accepted, as JSON writes it)."""
    value = d[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{path}{key}={d[key]!r}: use a whole number >= {low}")
    return value


def _real(d: Mapping[str, Any], key: str, path: str, default: float = 0.0) -> float:
    """A finite number >= 0."""
    value = d.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise ConfigError(f"{path}{key}={value!r}: use a finite number >= 0")
    return float(value)


def _stage(zero: Mapping[str, Any], offloads: bool) -> int | None:
    if "stage" not in zero:
        return None
    stage = zero["stage"]
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(f"zero_optimization.stage={stage!r}: use 0, 1, 2 or 3 (a number; "
                          "the engine's meaning of each: superoffload/ds_config.py)")
    if stage == 0 and offloads:
        raise ConfigError("zero_optimization.stage=0 with offload_optimizer.device='cpu': "
                          "optimizer offload needs ZeRO stage 1, 2 or 3 (as in DeepSpeed); "
                          "set stage 2, or offload_optimizer.device 'none'")
    return stage


def _unknown(d: Mapping[str, Any], known: set[str], path: str) -> None:
    known = known | ds_keys.harmless_under(path)
    for key in d:
        if key not in known:
            raise ConfigError(f"unknown DeepSpeed key {path}{key!r}; supported here: "
                              f"{', '.join(sorted(known))}")


def from_deepspeed(source: Mapping[str, Any] | str | os.PathLike[str], *,
                   auto: Mapping[str, Any] | None = None
                   ) -> tuple[OffloadConfig, dict[str, Any]]:
    """Convert a DeepSpeed config (a dict or a JSON file path, as Trainer's ``deepspeed=``
    takes it); returns (validated OffloadConfig, optimizer kwargs). ``auto``: dotted key ->
    value for "auto" entries (``ds_keys.auto_values(training_args)``); without one they are
    dropped (the engine's defaults). What is accepted without effect, "auto" and a dropped
    scheduler are said once, as a ``DeepSpeedNotice`` warning, and kept in
    ``config.extra["deepspeed"]`` (superoffload/ds_keys.py)."""
    raw, where = ds_keys.read(source)
    ds, notes = ds_keys.resolve_ds_keys(raw, auto)
    config, opt, differences = _convert(ds)
    notes["defaults"] = differences
    text = ds_keys.notice(notes, where)
    if text:
        warnings.warn(text, ds_keys.DeepSpeedNotice, stacklevel=2)
        config = config.replace(extra={**config.extra, "deepspeed": {
            k: list(v) for k, v in notes.items() if v}})
    return config, opt


def _convert(ds: Mapping[str, Any]) -> tuple[OffloadConfig, dict[str, Any], list[str]]:
    """The conversion proper, on a dict ``ds_keys.resolve_ds_keys`` has cleaned: (config, optimizer
    kwargs, the defaults that differ from DeepSpeed's, one line each)."""
    _unknown(ds, _TOP, "")
    fields: dict[str, Any] = {}

    for key in ("wall_clock_breakdown", "zero_allow_untested_optimizer"):
        if key in ds:
            _bool(ds, key, "")
    counts = {key: _int(ds, key, "", low=1) for key in (
        "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")
        if key in ds}
    gas = counts.get("gradient_accumulation_steps", 1)
    fields["grad_accum_steps"] = gas
    micro, total = counts.get("train_micro_batch_size_per_gpu"), counts.get("train_batch_size")
    if micro is not None and total is not None and total != micro * gas:
        raise ConfigError(
            f"train_batch_size={total} contradicts train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={gas} (one process); drop one of them")
    clip = _real(ds, "gradient_clipping", "")
    # DeepSpeed's gradient_clipping 0.0 (its default) means no clipping, as None does here
    fields["max_grad_norm"] = clip or None

    fp16, bf16 = _section(ds, "fp16", ""), _section(ds, "bf16", "")
    _unknown(fp16, _FP16, "fp16.")
    _unknown(bf16, _BF16, "bf16.")
    fp16_on, bf16_on = _bool(fp16, "enabled", "fp16."), _bool(bf16, "enabled", "bf16.")
    if "auto_cast" in fp16:
        _bool(fp16, "auto_cast", "fp16.")
    if fp16_on and bf16_on:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one precision")
    # at most one is on (refused above): fp16 overrides this below
    fields["precision"] = "bf16" if bf16_on else "fp32"
    if fp16_on:
        fields["precision"] = "fp16"
        scale = _real(fp16, "loss_scale", "fp16.")
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
    for key in ("overlap_comm", "contiguous_gradients"):
        if key in zero:
            _bool(zero, key, "zero_optimization.")
    # elements -> bytes of fp32 gradient
    if "reduce_bucket_size" in zero:
        fields["bucket_bytes"] = _int(zero, "reduce_bucket_size", "zero_optimization.", low=1) * 4
    off = _section(zero, "offload_optimizer", "zero_optimization.")
    _unknown(off, _OFFLOAD, "zero_optimization.offload_optimizer.")
    # an offload_optimizer section without a device offloads to the CPU (DeepSpeed's default);
    # no section at all offloads nothing
    device = off.get("device", "cpu" if off else "none")
    _stage(zero, offloads=device in ("cpu", "nvme"))
    if device not in ("cpu", "nvme", "none"):
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device={device!r}: use 'cpu', 'nvme' (the "
            "storage tier, docs/storage.md) or 'none'")
    fields.update(_storage(off, device, _section(ds, "aio", "")))
    if device == "nvme":
        # the offload schedule; the tier holds the state (docs/storage.md)
        device = "cpu"
    if device == "none":
        if off.get("ratio", 0.0):
            raise ConfigError(
                "zero_optimization.offload_optimizer.ratio > 0 contradicts device='none'")
        fields["ratio"] = 0.0
    elif "ratio" in off:
        fields["ratio"] = off["ratio"]
    path = "zero_optimization.offload_optimizer."
    if "pin_memory" in off:
        fields["pin_memory"] = _bool(off, "pin_memory", path)
    if "cpuadam_cores_perc" in off:
        fields["cpu_cores_frac"] = off["cpuadam_cores_perc"]
    if not _bool(off, "super_offload", path, default=True):
        # ZeRO-Offload schedule: step after validation
        fields["speculation"] = "off"
    for key, value in _offload_param(zero, fields.get("storage_path")).items():
        if key in fields and fields[key] != value:
            raise ConfigError(f"zero_optimization.offload_param gives {key}={value!r} and "
                              f"zero_optimization.offload_optimizer {fields[key]!r}: one "
                              "setting here (the weights live with the optimizer state)")
        fields[key] = value

    overrides = _section(ds, "superoffload", "")
    names = {f.name for f in dataclasses.fields(OffloadConfig)}
    _unknown(overrides, names, "superoffload.")
    for key, value in overrides.items():
        if key in fields and fields[key] != value:
            raise ConfigError(f"superoffload.{key}={value!r} contradicts the DeepSpeed setting "
                              f"that gives {fields[key]!r}")
    fields.update(overrides)
    differences: list[str] = []
    # DeepSpeed's defaults for what the dict leaves out (module docstring)
    if device == "cpu":
        given = {"ratio": "ratio" in off, "cpu_cores_frac": "cpuadam_cores_perc" in off}
        for name, value in DEEPSPEED_DEFAULTS.items():
            if not given[name]:
                fields.setdefault(name, value)
        present = {"zero_optimization.offload_optimizer.super_offload":
                   "super_offload" in off or "speculation" in overrides,
                   "zero_optimization.offload_optimizer.pin_memory":
                   "pin_memory" in off or "pin_memory" in overrides,
                   "zero_optimization.reduce_bucket_size":
                   "reduce_bucket_size" in zero or "bucket_bytes" in overrides}
        differences = [f"{key} {why}" for key, why in DIFFERENCES.items() if not present[key]]
    if micro is not None:
        fields["extra"] = {**fields.get("extra", {}), "train_micro_batch_size_per_gpu": micro}
    try:
        config = OffloadConfig(**fields).validate()
    except TypeError as exc:
        # a wrong type that the dataclass constructor rejects
        raise ConfigError(f"DeepSpeed config: {exc}") from exc
    return config, _optimizer(ds), differences


def _storage(off: Mapping[str, Any], device: str, aio: Mapping[str, Any]) -> dict[str, Any]:
    """``offload_optimizer.device: "nvme"`` with ``nvme_path`` and ``buffer_count``, and the
    ``aio`` block, as OffloadConfig's storage fields (DeepSpeed's meanings; what differs is
    refused naming the difference)."""
    path, out = "zero_optimization.offload_optimizer.", {}
    _unknown(aio, _AIO, "aio.")
    for key in ("single_submit", "overlap_events", "use_gds"):
        if key in aio:
            _bool(aio, key, "aio.")
    if aio.get("use_gds"):
        raise ConfigError("aio.use_gds=true: GPUDirect Storage (NVMe to GPU memory) is not "
                          "supported; the tier reads into pinned host buffers (drop use_gds)")
    if "thread_count" in aio and "intra_op_parallelism" in aio \
            and aio["thread_count"] != aio["intra_op_parallelism"]:
        raise ConfigError("aio.thread_count and aio.intra_op_parallelism differ: they are one "
                          "setting (parallel submitting threads); give one")
    for key, field in AIO_FIELDS.items():
        if key in aio:
            out[field] = _int(aio, key, "aio.", low=1)
    if device != "nvme":
        for key in ("nvme_path", "buffer_count"):
            if key in off:
                raise ConfigError(f"{path}{key} is set but {path}device={device!r}: it applies "
                                  "to device 'nvme' only")
        return out
    if not isinstance(off.get("nvme_path"), str) or not off["nvme_path"].strip():
        raise ConfigError(f"{path}device='nvme' needs {path}nvme_path: the folder on a local "
                          "NVMe disk where the optimizer state lives")
    out["storage_path"] = off["nvme_path"]
    if "buffer_count" in off:
        count = _int(off, "buffer_count", path, low=AIO_STATES_PER_BUFFER)
        if count % AIO_STATES_PER_BUFFER:
            raise ConfigError(
                f"{path}buffer_count={count}: DeepSpeed's buffers hold one state tensor each "
                f"and Adam has {AIO_STATES_PER_BUFFER} per bucket; here a buffer holds all "
                f"{AIO_STATES_PER_BUFFER}, so use a multiple of {AIO_STATES_PER_BUFFER} "
                f"(buffer_count / {AIO_STATES_PER_BUFFER} buckets in flight), or "
                "superoffload.storage_buffer_count")
        out["storage_buffer_count"] = count // AIO_STATES_PER_BUFFER
    return out


def _offload_param(zero: Mapping[str, Any], state_path: str | None) -> dict[str, Any]:
    """``offload_param`` (DeepSpeed ZeRO-3's parameter offload) as weight-flow: the blocks'
    weights live on the host ("cpu": ``weight_homes="host"``) or in the storage tier's file
    beside each bucket's optimizer state ("nvme": ``"storage"``; so the state must be there
    too, ``state_path``), read through ``buffer_count`` = ``prefetch_depth + 1`` buffers."""
    path = "zero_optimization.offload_param."
    par = _section(zero, "offload_param", "zero_optimization.")
    _unknown(par, _PARAM, path)
    device = par.get("device", "none")
    if device not in ("cpu", "nvme", "none"):
        raise ConfigError(f"{path}device={device!r}: use 'cpu', 'nvme' or 'none'")
    for key in ("nvme_path", "buffer_count"):
        if key in par and device != "nvme":
            raise ConfigError(f"{path}{key} is set but {path}device={device!r}: it applies "
                              "to device 'nvme' only")
    if device == "none":
        return {}
    if zero.get("stage") != 3:
        raise ConfigError(f"{path}device={device!r} needs zero_optimization.stage 3, as in "
                          "DeepSpeed (set stage 3; the engine streams the weights itself)")
    if device == "nvme" and par.get("nvme_path") != state_path:
        raise ConfigError(f"{path}device='nvme' keeps each bucket's weights in the storage "
                          "tier's file beside its optimizer state: set zero_optimization."
                          "offload_optimizer.device='nvme' with the same nvme_path")
    out: dict[str, Any] = {"weights": "flow",
                           "weight_homes": "host" if device == "cpu" else "storage"}
    if "pin_memory" in par:
        out["pin_memory"] = _bool(par, "pin_memory", path)
    if "buffer_count" in par:
        # one of DeepSpeed's buffers holds the block running; the rest are fetched ahead
        out["prefetch_depth"] = _int(par, "buffer_count", path, low=2) - 1
    return out


def _optimizer(ds: Mapping[str, Any]) -> dict[str, Any]:
    opt = _section(ds, "optimizer", "")
    _unknown(opt, {"type", "params"}, "optimizer.")
    kind = str(opt.get("type", "AdamW"))
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type={kind!r}: the engine runs Adam/AdamW; use one of them")
    params = _section(opt, "params", "optimizer.")
    _unknown(params, _OPT_PARAMS, "optimizer.params.")
    out: dict[str, Any] = {}
    for key in ("bias_correction", "adam_w_mode", "torch_adam"):
        if key in params:
            _bool(params, key, "optimizer.params.")
    for key in ("lr", "eps", "weight_decay", "bias_correction"):
        if key in params:
            out[key] = params[key]
    if "betas" in params:
        out["betas"] = tuple(params["betas"])
    # DeepSpeed: "AdamW" is decoupled decay; "Adam" follows adam_w_mode, default True.
    adamw = kind.lower() == "adamw" or params.get("adam_w_mode", True)
    if kind.lower() == "adamw" and params.get("adam_w_mode") is False:
        raise ConfigError("optimizer.params.adam_w_mode=false contradicts optimizer.type='AdamW'")
    out["adamw_mode"] = adamw
    return out
