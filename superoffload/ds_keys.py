"""DeepSpeed JSON as people write it for Hugging Face Trainer (docs/integrations.md).

``ds_config.from_deepspeed`` converts what changes the engine; this module prepares the rest:

* a path (what Trainer's ``deepspeed=`` takes) is read; its errors name the file;
* ``"auto"`` values (Trainer fills them from TrainingArguments: transformers'
  ``HfTrainerDeepSpeedConfig.trainer_config_process``) take the value given in ``auto``
  (dotted key -> value, ``auto_values(training_args)`` builds it) or are dropped, the
  engine's default standing in, and listed;
* keys that do not change the maths of one process are accepted and listed: communication
  buckets and overlap (``allgather_*``, ``reduce_scatter``, ``overlap_comm``, ...), ZeRO-3's
  parameter-partitioning knobs, logging (``steps_per_print``, ``wall_clock_breakdown``, ...);
* keys that would change results, or memory in a way the engine does not do, are refused by
  name with the way to get the same here (``REFUSED``);
* the ``scheduler`` section is not run: the notice says which schedule runs instead;
* a default this engine reads differently from DeepSpeed (``ds_config.DIFFERENCES``) is
  said, one line per key left out.

The listing is one ``DeepSpeedNotice`` warning per conversion (and ``config.extra
["deepspeed"]``), so a run says once, at its start, what of its JSON it does not use.
Key names and meanings: deepspeed.ai/docs/config-json; the ZeRO-2/3 examples of the
Hugging Face DeepSpeed guide (huggingface.co/docs/transformers/deepspeed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from superoffload.config import ConfigError
from superoffload.jsonfile import parse_object

HARMLESS = frozenset({
    # logging and tooling
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    # data-parallel communication: one process has no peer to talk to
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "zero_optimization.allgather_partitions", "zero_optimization.allgather_bucket_size",
    "zero_optimization.reduce_scatter", "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients", "zero_optimization.round_robin_gradients",
    "zero_optimization.sub_group_size", "zero_optimization.elastic_checkpoint",
    "zero_optimization.load_from_fp32_weights", "zero_optimization.ignore_unused_parameters",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.fast_init",
    # the storage tier always batches its requests and overlaps their completions: how
    # DeepSpeed submits them does not change what is computed
    "aio.single_submit", "aio.overlap_events",
    # weight-flow sizes its staging buffers by the largest bucket and keeps homes in memory
    # while the budget holds them (docs/storage.md, "Weights on the tier")
    "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.max_in_cpu",
})
"""Dotted keys accepted and listed: they do not change one process's results."""

REFUSED = {
    "activation_checkpointing": "DeepSpeed's activation checkpointing is not applied by this "
        "engine; enable it on the model (model.gradient_checkpointing_enable(), or "
        "GPTConfig(checkpointing=True))",
    "amp": "apex AMP changes the numerics; use bf16.enabled or fp16.enabled",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights change the numerics; the "
        "engine keeps fp32 masters",
    "data_types": "data_types.grad_accum_dtype changes how gradients accumulate; the engine "
        "accumulates in the model's dtype",
    "sparse_gradients": "sparse gradients are not supported",
    "compression_training": "compression changes the model; not supported",
    "curriculum_learning": "curriculum learning changes the data order; do it in your loop",
    "data_efficiency": "data sampling changes the data order; do it in your loop",
    "pipeline": "pipeline parallelism is not supported; see docs/distributed.md",
}
"""Dotted key -> why it is refused and what to use instead."""


class DeepSpeedNotice(UserWarning):
    """What of a DeepSpeed config the engine accepts without using (one per conversion)."""


def read(source: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the config dict, where it came from) from a dict or a JSON file path."""
    if isinstance(source, Mapping):
        return dict(source), "DeepSpeed config"
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"DeepSpeed config: expected a dict or a JSON file path, got "
                          f"{type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {path}: cannot read it ({exc.strerror or exc}); "
                          "pass the path of a JSON file or a dict") from None
    where = f"DeepSpeed config {path}"
    return parse_object(text, where, error=ConfigError), where


def auto_values(args: Any) -> dict[str, Any]:
    """Dotted key -> value for "auto" from Hugging Face ``TrainingArguments`` (what
    transformers' ``trainer_config_process`` fills in, one process)."""
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "train_batch_size": micro * gas, "gradient_clipping": args.max_grad_norm,
            "optimizer.params.lr": args.learning_rate,
            "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
            "optimizer.params.eps": args.adam_epsilon,
            "optimizer.params.weight_decay": args.weight_decay,
            "bf16.enabled": bool(args.bf16), "fp16.enabled": bool(args.fp16)}


def resolve_ds_keys(ds: Mapping[str, Any], auto: Mapping[str, Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(the dict with "auto" resolved and the scheduler removed; notes):
    notes["auto"], notes["ignored"], notes["scheduler"] list what the notice says. Refused
    keys raise ConfigError naming them."""
    auto = dict(auto or {})
    notes: dict[str, list[str]] = {"auto": [], "ignored": [], "scheduler": []}

    def walk(d: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in d.items():
            dotted = prefix + key
            if dotted in REFUSED and _active(value):
                raise ConfigError(f"DeepSpeed key {dotted} would change results or memory: "
                                  f"{REFUSED[dotted]}")
            # present but switched off
            if dotted in REFUSED:
                notes["ignored"].append(dotted)
                continue
            # kept for from_deepspeed's type checks, then unused
            if dotted in HARMLESS:
                notes["ignored"].append(dotted)
            if value == "auto":
                if dotted in auto:
                    out[key] = auto[dotted]
                    notes["auto"].append(f"{dotted}={auto[dotted]!r}")
                else:
                    notes["auto"].append(f"{dotted} (the engine's default)")
                continue
            out[key] = walk(value, dotted + ".") if isinstance(value, Mapping) else value
        return out

    cleaned = walk(ds, "")
    sched = cleaned.pop("scheduler", None)
    if sched is not None:
        notes["scheduler"].append(_scheduler_note(sched, cleaned))
    return cleaned, notes


def _active(value: Any) -> bool:
    """A refused section that is present but switched off (``{"enabled": false}``, an empty
    dict, false, none) is harmless."""
    if isinstance(value, Mapping):
        return bool(value) and value.get("enabled", True) is not False and \
            value.get("device", "cpu") != "none"
    return value not in (None, False, 0, "none")


def _scheduler_note(sched: Any, cleaned: Mapping[str, Any]) -> str:
    """Which learning-rate schedule runs instead of DeepSpeed's scheduler section."""
    kind = sched.get("type", "?") if isinstance(sched, Mapping) else "?"
    lr = None
    # the note must not fail on an optimizer section that is absent or not a mapping
    if isinstance(cleaned.get("optimizer"), Mapping):
        lr = cleaned["optimizer"].get("params", {}).get("lr")
    hold = f"optimizer.params.lr = {lr}" if lr is not None else "the optimizer's lr"
    return (f"scheduler {kind!r} is not run by the engine: the learning rate follows the torch "
            f"LR scheduler your loop steps on engine.optimizer (Trainer: its lr_scheduler_type "
            f"and warmup; `superoffload train`: linear warm-up then cosine); a loop that steps "
            f"none keeps {hold} from the first step, where DeepSpeed's {kind} would change it")


def harmless_under(path: str) -> set[str]:
    """The HARMLESS keys directly under dotted section `path` ("" for the top level)."""
    return {k[len(path):] for k in HARMLESS if k.startswith(path) and "." not in k[len(path):]}


def notice(notes: Mapping[str, list[str]], where: str) -> str:
    """The one-paragraph listing (empty when there is nothing to say)."""
    parts = []
    if notes.get("ignored"):
        parts.append("accepted without effect for one process: " + ", ".join(notes["ignored"]))
    if notes.get("auto"):
        parts.append('"auto" resolved: ' + ", ".join(notes["auto"]))
    parts += list(notes.get("scheduler", []))
    if notes.get("defaults"):
        parts.append("defaults that differ from DeepSpeed's: " + "; ".join(notes["defaults"]))
    return f"{where}: " + "; ".join(parts) if parts else ""
