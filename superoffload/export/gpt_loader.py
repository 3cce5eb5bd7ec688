"""Loading an exported folder back: our GPT from its config.json, and any folder's tensors.

``load_gpt(folder)`` builds models/gpt.py's ``GPT`` from a config.json of model type
``superoffload-gpt`` (companions.py writes it) and loads the weights; the tied head is tied
again by the model itself (it shares the embedding's tensor), so the folder holds it once.
``load_tensors(folder)`` reads every tensor of a folder (one file or shards with their
index), for checks; it loads everything, so it is for small models and tests.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields

import torch

from superoffload.export.companions import CONFIG, GPT_MODEL_TYPE
from superoffload.export.safetensors_file import read_header, read_tensor


def weight_files(folder: str, stem: str = "model") -> list[str]:
    """The folder's weight files: those its index names, or ``<stem>.safetensors``."""
    index = os.path.join(folder, f"{stem}.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, f"{stem}.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{folder} holds neither {stem}.safetensors nor its index")
    return [single]


def load_tensors(folder: str, stem: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of the exported folder, by key."""
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(folder, stem):
        stored, _ = read_header(file)
        for key, s in stored.items():
            out[key] = read_tensor(file, s)
    return out


def load_gpt(folder: str) -> torch.nn.Module:
    """models/gpt.py's ``GPT`` with the exported weights, in the dtype they were written."""
    from superoffload.models.gpt import GPT, GPTConfig

    with open(os.path.join(folder, CONFIG)) as f:
        config = json.load(f)
    if config.get("model_type") != GPT_MODEL_TYPE:
        raise ValueError(f"{folder}: config.json has model_type {config.get('model_type')!r}, "
                         f"not {GPT_MODEL_TYPE!r}; load a Hugging Face model with "
                         "transformers' from_pretrained")
    names = {f.name for f in fields(GPTConfig)}
    model = GPT(GPTConfig(**{k: v for k, v in config.items() if k in names}))
    tensors = load_tensors(folder)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # the only key a complete folder may lack is the head tied to the embedding
    tied = {k for k in missing if _same_tensor(model, k, tensors)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{folder}: weights do not fit the config: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return model


def _same_tensor(model: torch.nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """``key`` is an alias of a loaded key in ``model`` (a tied weight)."""
    state = model.state_dict(keep_vars=True)
    return any(state[key] is state[k] for k in loaded if k in state)
