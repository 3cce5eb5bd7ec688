"""Reading checkpoints of the former ZeRO engine ("superoffload-zero/1"), to convert them.

That engine wrote ``manifest.json`` (world size, files and their SHA-256, step counts, the
common payload) and one sealed file per rank: its segments of each parameter as (name,
offset, master, exp_avg, exp_avg_sq) fp32 tensors and its RNG states; rank 0's also the
model's other tensors, ``extra`` and the LR scheduler's state. ``consolidate`` rebuilds each
full fp32 tensor from its pieces (checking they tile it); the FSDP2 engine loads that like
any full state, each rank keeping its shards (checkpoint.py), and saves DCP afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.runtime import engine_checkpoint as single
from superoffload.runtime.ckpt_files import read_verified
from superoffload.runtime.engine_state import ParamState

FORMAT = "superoffload-zero/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class ConsolidatedState:
    """A sharded checkpoint put back together (any world size, either format)."""

    manifest: dict[str, Any]
    states: dict[str, ParamState]
    """Full fp32 master, moments and step per trainable parameter."""
    model_rest: dict[str, torch.Tensor]
    """The model's other state-dict entries (buffers, frozen parameters)."""
    rng: list[Any]
    """Each writing rank's RNG states, by rank."""
    extra: Any
    lr_scheduler: Any = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One fp32 state dict: the master weights plus the model's other entries."""
        return {**self.model_rest, **{n: s.master for n, s in self.states.items()}}


def consolidate(path: str, manifest: dict[str, Any]) -> ConsolidatedState:
    """Every full fp32 tensor of the former ZeRO checkpoint at ``path``."""
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    files = []
    for r, name in enumerate(manifest["files"]):
        if not os.path.exists(os.path.join(path, name)):
            raise FileNotFoundError(f"sharded checkpoint {path}: {name} (rank {r} of "
                                    f"{manifest['world_size']}) is missing; copy every rank's file")
        payload = read_verified(os.path.join(path, name),
                                sha256=manifest.get("sha256", {}).get(name))
        if (payload["rank"], payload["world_size"]) != (r, manifest["world_size"]):
            raise single.CheckpointMismatch(f"{name}: holds rank {payload['rank']} of "
                                            f"{payload['world_size']}, the manifest expects {r}")
        for pname, off, m, a, s in payload["segments"]:
            pieces.setdefault(pname, []).append((int(off), m, a, s))
        files.append(payload)
    states = {}
    for pname, shape, _dtype, _trainable in manifest["signature"]:
        if pname not in manifest["steps"]:
            continue
        parts = sorted(pieces.get(pname, []), key=lambda t: t[0])
        covered = 0
        for off, m, _, _ in parts:
            if off != covered:
                raise single.CheckpointMismatch(
                    f"parameter {pname!r}: elements [{covered}, {off}) are missing or overlap "
                    "in the rank files (a file from another save?)")
            covered += m.numel()
        if covered != torch.Size(shape).numel():
            raise single.CheckpointMismatch(f"parameter {pname!r}: {covered} of "
                                            f"{torch.Size(shape).numel()} elements found")
        master, exp_avg, exp_avg_sq = (
            torch.cat([t[k] for t in parts]).view(shape)  # type: ignore[misc]
            for k in (1, 2, 3))
        states[pname] = ParamState(master, exp_avg, exp_avg_sq, int(manifest["steps"][pname]))
    first = files[0]
    return ConsolidatedState(manifest, states, first["model_rest"], [f["rng"] for f in files],
                             first.get("extra"), first.get("lr_scheduler"))


def read_manifest(path: str) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` at ``path``, or None when there is none."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    with open(file) as f:
        return dict(json.load(f))
