"""A peft (LoRA, ...) run exported as its adapter: ``adapter_model.safetensors`` and
``adapter_config.json``, the folder ``PeftModel.from_pretrained(base_model, folder)`` loads
(docs/export.md, "peft"). The adapter's trained tensors come from their fp32 masters; the
base model is not written (it did not train). Merging into the base is peft's own step
(``merge_and_unload``), shown in docs/export.md.

Key names are peft's: the adapter name is dropped (``...lora_A.default.weight`` is stored as
``...lora_A.weight``). Live, peft itself says which state-dict entry is stored under which
key (``get_peft_model_state_dict``); from a Trainer checkpoint, the keys are those of the
``adapter_model.safetensors`` Trainer saved beside the masters, each matched to the master
whose name is the key plus one dotted segment (the adapter name). A master that matches no
key, or two, is an error: nothing trained is left behind silently.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch

from superoffload.export.engine_file import PayloadSource
from superoffload.export.live_engine import LiveSource
from superoffload.export.safetensors_file import Stored, read_header, read_tensor
from superoffload.export.source import Entry, Extras

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(model: Any) -> bool:
    """A ``peft.PeftModel`` (without importing peft where it is not installed)."""
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


class PeftLiveSource(LiveSource):
    """A live engine training a ``PeftModel``: its active adapter."""

    stem = "adapter_model"
    single_file = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        model = engine.model
        self.adapter = str(model.active_adapter)
        self.config = model.peft_config[self.adapter]

    def extras(self) -> Extras:
        return Extras(texts={ADAPTER_CONFIG: _config_text(self.config)})

    def entries(self) -> list[Entry]:
        from peft import get_peft_model_state_dict

        stored = get_peft_model_state_dict(self.engine.model, state_dict=self.model_state,
                                           adapter_name=self.adapter)
        name_of = {id(t): k for k, t in self.model_state.items()}
        out = []
        for key, t in stored.items():
            name = name_of.get(id(t))
            if name is None:
                raise RuntimeError(f"peft stores adapter key {key!r} as a tensor that is not "
                                   "the model's own; this peft version is not supported")
            master = name in self.where
            out.append(Entry(key, name, self._shape(name),
                             torch.float32 if master else t.dtype, master))
        _check_every_master_kept(out, self.where, self.what)
        return out


def _config_text(config: Any) -> str:
    """adapter_config.json as peft writes it for inference (``inference_mode=True``)."""
    config = copy.copy(config)
    config.inference_mode = True
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        with open(os.path.join(tmp, ADAPTER_CONFIG)) as f:
            return f.read()


def _check_every_master_kept(entries: list[Entry], masters: Any, what: str) -> None:
    kept = {e.name for e in entries if e.master}
    lost = sorted(n for n in masters if n not in kept)
    if lost:
        raise ValueError(f"{what}: trained parameter(s) {lost[:3]} (of {len(lost)}) have no key "
                         "in the peft adapter, so the adapter would lose them; export the whole "
                         "model instead (merge the adapter first: docs/export.md, \"peft\")")


class PeftCheckpointSource(PayloadSource):
    """A Trainer checkpoint of a ``PeftModel``: masters from optimizer.pt, keys (and the
    adapter's untrained tensors) from the adapter_model.safetensors beside it."""

    single_file = True

    def __init__(self, payload: dict[str, Any], path: str, extras: Extras) -> None:
        super().__init__(payload, f"Trainer checkpoint {path} (peft adapter)",
                         stem="adapter_model", extras=extras)
        self.adapter_file = os.path.join(path, ADAPTER_WEIGHTS)
        if not os.path.isfile(self.adapter_file):
            raise FileNotFoundError(f"{path} holds {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} "
                                    "(save with save_safetensors=True, the default)")
        self.stored, _ = read_header(self.adapter_file)
        extras.files[ADAPTER_CONFIG] = os.path.join(path, ADAPTER_CONFIG)

    def entries(self) -> list[Entry]:
        by_key: dict[str, list[str]] = {}
        for name in self.state:
            parts = name.split(".")
            # the name without one segment: the adapter's
            for i in range(len(parts)):
                by_key.setdefault(".".join(parts[:i] + parts[i + 1:]), []).append(name)
        out = []
        for key, s in self.stored.items():
            names = by_key.get(key, [])
            if len(names) > 1:
                raise ValueError(f"{self.what}: adapter key {key!r} matches several trained "
                                 f"parameters {names}; it cannot be exported unambiguously")
            if names:
                out.append(Entry(key, names[0], s.shape, torch.float32, True))
            else:
                # not trained here (peft saved it from the model): as the adapter holds it
                out.append(Entry(key, key, s.shape, s.dtype, False))
        _check_every_master_kept(out, self.state, self.what)
        return out

    def read_other(self, name: str) -> torch.Tensor:
        stored: Stored = self.stored[name]
        return read_tensor(self.adapter_file, stored)
