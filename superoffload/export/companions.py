"""config.json and the small files of a Hugging Face folder, from wherever they are known.

* a live model: a ``transformers`` model's own config (and generation config); our GPT's
  ``GPTConfig`` as ``{"model_type": "superoffload-gpt", ...}`` (``export.load_gpt`` reads it);
* a Trainer ``checkpoint-N`` or a model folder given with ``--config``: its config.json,
  generation_config.json and tokenizer files, copied;
* a ``python -m superoffload train`` checkpoint: the model its ``train.json`` settings built
  (commands/checkpointing.py writes that file beside the engine's);
* otherwise none: the report says so and how to add one (``--config``).

The config's dtype entry is set to the export's dtype, so ``from_pretrained(dtype="auto")``
loads what was written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from superoffload.export.source import Extras

GPT_MODEL_TYPE = "superoffload-gpt"
CONFIG = "config.json"
COMPANION_PREFIXES = ("config.json", "generation_config.json", "tokenizer", "vocab", "merges",
                      "special_tokens_map", "added_tokens", "chat_template",
                      "preprocessor_config", "processor_config")
"""Files copied from a model or checkpoint folder: config, generation config, tokenizer and
processor files (by how Hugging Face names them; weights, their index and a Trainer's own
state are never copied)."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def with_dtype(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``config`` with its dtype entry set to ``dtype``: ``torch_dtype`` where the config uses
    that older key, else ``dtype``."""
    out = dict(config)
    key = "torch_dtype" if "torch_dtype" in out and "dtype" not in out else "dtype"
    out[key] = DTYPE_NAMES[dtype]
    return out


def folder_extras(folder: str) -> Extras:
    """config.json and the companion files of a model or checkpoint folder."""
    extras = Extras()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(COMPANION_PREFIXES) and os.path.isfile(path):
            extras.files[name] = path
    if CONFIG in extras.files:
        extras.config = read_config(extras.files.pop(CONFIG))
        extras.config_from = os.path.join(folder, CONFIG)
    return extras


def read_config(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as a JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object, this holds a "
                         f"{type(config).__name__}")
    return config


def config_override(path: str) -> Extras:
    """``--config PATH``: a config.json, or a model folder holding one (its tokenizer files
    come along)."""
    if os.path.isdir(path):
        extras = folder_extras(path)
        if extras.config is None:
            raise FileNotFoundError(f"--config {path}: the folder holds no {CONFIG}; pass a "
                                    "config.json or the base model's folder")
        return extras
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file or folder")
    return Extras(config=read_config(path), config_from=path)


def hf_pretrained(model: torch.nn.Module) -> tuple[str, Any] | None:
    """(name, module) of the outermost ``transformers`` model inside ``model`` (the model
    itself: name ""), or None (no transformers, or none inside)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return name, module
    return None


def hf_model_extras(hf_model: Any) -> Extras:
    """A live ``transformers`` model's config (``architectures`` set, as ``save_pretrained``
    sets it) and generation config."""
    config = hf_model.config.to_dict()
    config["architectures"] = [type(hf_model).__name__]
    extras = Extras(config=config, config_from=f"the model's config ({type(hf_model).__name__})")
    generation = getattr(hf_model, "generation_config", None)
    if generation is not None and hf_model.can_generate():
        extras.texts["generation_config.json"] = generation.to_json_string(use_diff=True)
    return extras


def gpt_extras(model_config: Any) -> Extras:
    """Our GPT's config (models/gpt.py ``GPTConfig``) as config.json."""
    config = {"model_type": GPT_MODEL_TYPE, "architectures": ["GPT"], **asdict(model_config)}
    return Extras(config=config, config_from="the model's GPTConfig")


def model_extras(model: torch.nn.Module) -> tuple[Extras, str]:
    """What a live model's folder carries, and the prefix its state-dict keys drop: a
    ``transformers`` model inside a wrapper (``train --hf``'s adapter) is exported as that
    model. (Extras(), "") when nothing is known of the model."""
    from superoffload.models.gpt import GPTConfig

    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        return gpt_extras(cfg), ""
    found = hf_pretrained(model)
    if found is None:
        return Extras(), ""
    name, hf_model = found
    return hf_model_extras(hf_model), (name + "." if name else "")


def run_extras(folder: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[Extras, str]:
    """The model of a ``python -m superoffload train`` checkpoint, from its ``train.json``
    (the settings that built it) and the checkpoint's shapes; (Extras(), "") for any other."""
    from superoffload.commands.checkpointing import RUN_FORMAT, TRAIN_JSON

    try:
        with open(os.path.join(folder, TRAIN_JSON)) as f:
            meta = json.load(f)
        run = meta["run"] if meta.get("format") == RUN_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        run = None
    if not isinstance(run, dict):
        return Extras(), ""
    if run.get("hf"):
        from superoffload.models.hf_lm import tiny_hf_causal_lm

        # it seeds torch's generator: leave the caller's alone
        with torch.random.fork_rng():
            extras, prefix = model_extras(tiny_hf_causal_lm(block_size=int(run["seq"]),
                                                            seed=int(run["seed"])))
    else:
        from superoffload.models.gpt import PRESETS

        try:
            cfg = PRESETS[str(run["model"])](checkpointing=bool(run.get("checkpointing")))
            # the run may have widened the context beyond the preset's: the shapes say how much
            cfg.vocab_size, cfg.block_size = shapes["wte.weight"][0], shapes["wpe.weight"][0]
        except (KeyError, IndexError, ValueError, TypeError):
            # not a model this version builds
            return Extras(), ""
        extras, prefix = gpt_extras(cfg), ""
    extras.config_from = f"{os.path.join(folder, TRAIN_JSON)} (the model the run built)"
    return extras, prefix
