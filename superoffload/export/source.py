"""What an export reads: the tensors of a run, each from its fp32 master when it has one.

Every source (a live engine, an ``engine.pt`` checkpoint, a Trainer ``checkpoint-N``, an
FSDP2/DCP checkpoint) answers the same questions, so the writer (writer.py) never knows
which one it reads:

* ``entries()``: every tensor the folder will hold (its key there, its name at the source,
  shape, stored dtype, and whether it is read from an fp32 master), metadata only;
* ``read_master(name)``: one trainable parameter's fp32 master. Each checkpoint format reads
  a master through this one method, so a format whose masters live elsewhere (files of a
  storage tier) changes that method and nothing else;
* ``read_other(name)``: a tensor without a master (a buffer, a frozen parameter), as the
  model holds it;
* ``extras()``: config.json and the small files a Hugging Face folder carries.

A tied weight (an output head sharing the embedding's tensor) is one entry, under the name
the parameter has in ``named_parameters()`` and read from its one fp32 master; Hugging Face's
``from_pretrained`` and ``export.load_gpt`` tie the alias again (docs/export.md, "Tied
weights").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class NotACheckpoint(ValueError):
    """A path that holds no run to export: the message says what was found there and what
    an export reads."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of the export."""

    key: str
    """Its name in the exported folder."""
    name: str
    """Its name at the source (the engine's parameter name, or a state-dict key)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """As the source stores it (float32 for a master)."""
    master: bool
    """Read with ``read_master`` (an fp32 master), else with ``read_other``."""


@dataclass(slots=True)
class Extras:
    """The files of a Hugging Face folder besides the weights."""

    config: dict[str, Any] | None = None
    """config.json's contents; the writer sets its dtype to the export's."""
    config_from: str = ""
    """Where the config came from, for the report."""
    files: dict[str, str] = field(default_factory=dict)
    """Output name -> path of a file copied as it is (tokenizer files, generation config)."""
    texts: dict[str, str] = field(default_factory=dict)
    """Output name -> contents (a peft adapter's adapter_config.json)."""


class Source(Protocol):
    what: str
    """What is read, for messages ("engine checkpoint /runs/a/checkpoint")."""
    stem: str
    """Weights file stem: "model" (model.safetensors) or "adapter_model" (peft)."""
    single_file: bool
    """The weights go into one file whatever the bound (a peft adapter: small, and peft
    loads one file)."""

    def entries(self) -> list[Entry]: ...

    def read_master(self, name: str) -> torch.Tensor: ...

    def read_other(self, name: str) -> torch.Tensor: ...

    def extras(self) -> Extras: ...

    def close(self) -> None: ...


def alias_groups(keys: Iterable[str], identity: Callable[[str], Any]) -> list[list[str]]:
    """State-dict keys grouped by the tensor they name (``identity(key)``: equal for two keys
    of one tensor, None for a key that aliases nothing), in first-seen order."""
    groups: dict[Any, list[str]] = {}
    out: list[list[str]] = []
    for key in keys:
        ident = identity(key)
        if ident is None or ident not in groups:
            group = [key]
            out.append(group)
            if ident is not None:
                groups[ident] = group
        else:
            groups[ident].append(key)
    return out


def storage_identity(t: torch.Tensor) -> Any:
    """Two loaded state-dict tensors are one tensor when they view the same bytes the same
    way (``torch.load`` keeps shared storages shared); None for an empty tensor."""
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def plan_entries(groups: list[list[str]], shape_of: Callable[[str], tuple[int, ...]],
                 dtype_of: Callable[[str], torch.dtype], masters: Mapping[str, Any],
                 rename: Callable[[str], str] = str) -> list[Entry]:
    """One entry per group of aliases: the key that holds a master (a trainable parameter;
    ``masters`` maps its name to anything), else the first; ``rename`` maps a source name to
    the key in the folder."""
    out = []
    for group in groups:
        held = [k for k in group if k in masters]
        name = held[0] if held else group[0]
        dtype = torch.float32 if held else dtype_of(name)
        out.append(Entry(rename(name), name, shape_of(name), dtype, bool(held)))
    return out


def tensor_of(source: Source, entry: Entry) -> torch.Tensor:
    """The entry's tensor at the source: its fp32 master, or the model's own."""
    return source.read_master(entry.name) if entry.master else source.read_other(entry.name)
