"""Which tensor goes into which file of an exported Hugging Face folder (pure planning).

The layout is Hugging Face's (docs/export.md, "The folder"): one ``<stem>.safetensors``
when every tensor fits in ``max_shard_bytes``, else ``<stem>-00001-of-0000N.safetensors``
files and ``<stem>.safetensors.index.json``, whose ``weight_map`` names each tensor's file
and whose ``metadata.total_size`` is the sum of the tensors' bytes. Tensors fill files in
order, a new file starts when the next tensor would overflow the current one, and a tensor
larger than the bound gets a file of its own (what ``save_pretrained`` does), so no file
holds more than ``max(max_shard_bytes, largest tensor)``.

Data in, data out: no torch state, no files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
"""Decimal units as Hugging Face reads "5GB"; binary ones with an i ("5GiB")."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes of a size written as Hugging Face writes ``max_shard_size``: ``5GB`` (10^9),
    ``500MB``, ``2GiB`` (2^30) or a whole number of bytes; ValueError naming the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max shard size {value!r} is not a size: write a number of bytes "
                             "or one with a unit, e.g. 5GB, 500MB, 2GiB")
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"max shard size {value!r} must be at least 1 byte (e.g. 5GB)")
    return nbytes


@dataclass(frozen=True, slots=True)
class Shard:
    """One file of the export: its name and the tensors (keys, in write order) it holds."""

    file: str
    keys: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ShardPlan:
    shards: tuple[Shard, ...]
    index_file: str | None
    """``<stem>.safetensors.index.json`` when there are several files, else None."""

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def index(self) -> dict[str, object]:
        """The index file's contents (Hugging Face's: ``metadata.total_size``, ``weight_map``
        sorted by key)."""
        weight_map = {k: s.file for s in self.shards for k in s.keys}
        return {"metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items()))}


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int, *,
                stem: str = "model") -> ShardPlan:
    """Group ``(key, nbytes)`` (in order) into files of at most ``max_shard_bytes`` each (a
    larger tensor alone in its file); names them as Hugging Face does."""
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    filled = 0
    for key, nbytes in sizes:
        # the next tensor would overflow
        if current and filled + nbytes > max_shard_bytes:
            groups.append(current)
            current, filled = [], 0
        current.append((key, nbytes))
        filled += nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    shards = tuple(Shard(name, tuple(k for k, _ in g), sum(n for _, n in g))
                   for name, g in zip(names, groups))
    return ShardPlan(shards, f"{stem}.safetensors.index.json" if len(shards) > 1 else None)
