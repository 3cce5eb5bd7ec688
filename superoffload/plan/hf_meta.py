"""Any architecture ``transformers`` can build, read on the meta device.

The shipped families (llama, mistral, qwen2, gpt2, gpt_neox: plan/hf_config.py) are counted
from formulas without transformers. Every other ``model_type`` is instantiated here with
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` -- no weights, no memory,
well under a second for a 47 B MoE -- and described by ``ModelShape.from_module``
(plan/module_shape.py: exact parameters in registration order, GQA, gated MLP, MoE total vs
active over every block). Needs the ``hf`` extra (``pip install 'superoffload[hf]'``).

A config that names its own code (``auto_map``, what ``trust_remote_code`` would import:
DeepSeek-V3's Hub config does) is planned as data when transformers ships its
``model_type``: the architecture's own keys go to transformers' config class for that type
and ``auto_map`` is dropped, so no code from the config runs. ``config_keys`` says which keys
were read (the class's parameters) and which were not (``auto_map``, quantization, keys the
shipped class does not take, such as DeepSeek-V3's ``num_nextn_predict_layers``: its
multi-token-prediction layer is not built, and not planned). A ``model_type`` transformers
does not ship is refused: we never run code from a config.

The training dtype is not the config's ``torch_dtype`` (Gemma-2 ships ``float32`` weights and
trains in bf16 like the others): it is ``dtype`` (default bfloat16; ``plan --dtype``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from superoffload.plan.config_numbers import check_numbers
from superoffload.plan.size_limit import check_counts

LAYOUT_KEYS = {"moe_layer_freq": 1, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "first_k_dense_replace": 0}
"""Keys that decide which blocks are MoE, with the value that makes every block alike. One
that transformers' class for the model type does not read (DeepSeek's ``moe_layer_freq``)
is refused at any other value: the model built would not be the model described."""
DEFAULT_DTYPE = "bfloat16"
INSTALL = "pip install 'superoffload[hf]'"


def available() -> bool:
    """Whether transformers is installed (the meta-device path works)."""
    return importlib.util.find_spec("transformers") is not None


def build_meta(raw: Mapping[str, Any]) -> Any:
    """The model of config dict `raw`, on the meta device. ValueError naming the problem when
    transformers is missing, the model_type unknown to it, or the model needs remote code."""
    family = str(raw.get("model_type", ""))
    if not available():
        raise ValueError(f"HF config model_type={family!r}: reading it needs transformers "
                         f"({INSTALL}); without it the shipped families work: llama, "
                         "mistral, qwen2, gpt2, gpt_neox")
    import torch
    import transformers

    if raw.get("auto_map") and config_class(family) is None:
        raise ValueError(f"HF config model_type={family!r} names its own code (auto_map) and "
                         f"transformers {transformers.__version__} does not ship that model "
                         "type: the planner never runs code from a config; use a model type "
                         "transformers ships, or ModelShape.from_module on your model")
    read, _ = config_keys(raw)
    where = f"HF config ({family})"
    kinds = key_kinds(family)
    check_numbers(raw, read, where, kinds)  # each number read, checked once
    for key in layer_keys(family):  # before the config class builds per-layer lists
        if isinstance(raw.get(key), (int, float)):
            layers = int(raw[key])  # whole: checked above
            check_counts(layers, layers, f"{where}: {key}={layers:,}")  # >= 1 tensor a block
    for key, neutral in LAYOUT_KEYS.items():
        if config_class(family) is not None and key in raw and key not in read \
                and raw[key] not in (neutral, None):
            raise ValueError(f"HF config model_type={family!r}: {key}={raw[key]!r} is not read "
                             f"by transformers {transformers.__version__}'s {family} (it builds "
                             f"the blocks as if {key}={neutral!r}), so the count would not be "
                             "this model's; describe it with ModelShape.from_module instead")
    fields = {k: v for k, v in raw.items()
              if not k.startswith("_") and k not in ("model_type", "auto_map")}
    for key, value in fields.items():  # 1e3 is a whole number in JSON, an int to the class
        if kinds.get(key) == "whole" and isinstance(value, float):
            fields[key] = int(value)  # check_numbers made sure it has no fraction
    try:
        config = transformers.AutoConfig.for_model(family, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"HF config model_type={family!r}: transformers "
                         f"{transformers.__version__} does not know it ({exc})") from None
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise ValueError(f"HF config model_type={family!r} is not a causal language model "
                         f"transformers can build: {exc}") from None


def config_class(family: str) -> Any:
    """transformers' config class for ``model_type`` `family`, or None when it ships none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # a lazy mapping: only [] loads a class (its dict.get would miss one not loaded yet)
    return CONFIG_MAPPING[family] if family in CONFIG_MAPPING else None  # noqa: SIM401


def key_kinds(family: str) -> dict[str, str]:
    """What the config class of ``family`` declares each parameter to be: "whole" (an int,
    not a float), "flag" (a bool) or "number"; read from its ``__init__`` annotations, so the
    checks follow the class (plan/config_numbers.check_numbers)."""
    import inspect
    import typing

    cls = config_class(family)
    if cls is None:
        return {}
    kinds: dict[str, str] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        hint = param.annotation
        # a Union / Optional lists its members; a plain annotation is its own only member
        members = set(typing.get_args(hint)) if typing.get_args(hint) else {hint}
        # Optional[int] is still an int where the config sets it
        members.discard(type(None))
        if members == {bool}:
            kinds[name] = "flag"
        elif int in members and float not in members:
            # Union[int, float] accepts a fraction: only a pure int is "whole"
            kinds[name] = "whole"
        elif members & {int, float}:
            kinds[name] = "number"
    return kinds


def layer_keys(family: str) -> list[str]:
    """The keys that give ``family``'s block count: ``num_hidden_layers`` and the names its
    config class maps onto it (``attribute_map``, e.g. GPT-2's ``n_layer``)."""
    cls = config_class(family)
    aliases: dict[str, str] = {}
    if cls is not None:
        # attribute_map may be absent or None on a class that maps nothing
        aliases = dict(getattr(cls, "attribute_map", {}) or {})
    return ["num_hidden_layers", *(k for k, v in aliases.items() if v == "num_hidden_layers")]


def config_keys(raw: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(keys read, keys not read) of config dict `raw` on the meta-device path: read are the
    parameters of transformers' config class for its model_type that the dict sets (the
    architecture's own: not PretrainedConfig's generic ones); the rest is not read."""
    import inspect

    import transformers

    cls = config_class(str(raw.get("model_type", "")))
    common = set(inspect.signature(transformers.PretrainedConfig.__init__).parameters)
    own: set[str] = set()
    if cls is not None:
        own = set(inspect.signature(cls.__init__).parameters) - common
    # "_name_or_path" and the like are bookkeeping, not architecture
    keys = [k for k in raw if k != "model_type" and not k.startswith("_")]
    return (tuple(sorted(k for k in keys if k in own)),
            tuple(sorted(k for k in keys if k not in own)))


def shape_fields(raw: Mapping[str, Any], *, seq: int | None, micro_batch: int = 1,
                 max_seq: int = 4096, dtype: str | None = None, **kw: Any) -> dict[str, Any]:
    """ModelShape's fields for config dict `raw` via a meta-device model (module docstring).
    `seq` defaults to the context length capped at `max_seq`."""
    from superoffload.plan.module_shape import shape_fields as of_module

    model = build_meta(raw)
    positions = _context(model.config)
    if seq is None:
        # a long context (128k) would plan a sequence nobody trains by default
        seq = min(positions, max_seq)
    fields = of_module(model, seq=seq, micro_batch=micro_batch)
    fields["dtype"] = dtype or DEFAULT_DTYPE
    fields.update(kw)
    return fields


def _context(config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def describe_model(raw: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """What ``plan --hf-config`` reports about a meta-read model."""
    name = str(raw.get("_name_or_path") or (raw.get("architectures") or [raw.get("model_type")])[0])
    return {"name": name, "family": str(raw.get("model_type")), "layers": fields["layers"],
            "hidden": fields["hidden"], "heads": fields["heads"],
            "kv_heads": fields.get("kv_heads") or fields["heads"],
            "ffn": fields.get("ffn_hidden") or 4 * fields["hidden"], "vocab": fields["vocab"],
            "experts": fields.get("experts", 0),
            "experts_per_token": fields.get("experts_per_token", 0)}
