"""Reading a run from an engine state dict on disk: a single-process checkpoint's ``engine.pt``
(``engine.save_checkpoint``, runtime/engine_checkpoint.py) or a Trainer checkpoint's
``optimizer.pt`` (``SuperOffloadTrainer``: ``engine.state_dict()``, integrations/hf.py).

Both hold ``state`` (per trainable parameter name: the fp32 ``master`` and both moments),
``model`` (the model's state dict as the engine held it: low-precision weights, buffers,
frozen parameters, a tied head aliasing its embedding) and ``signature``. The file is opened
with ``torch.load(mmap=True, weights_only=True)``: tensors stay in the file (pages the kernel
can drop) until one is read, so memory holds one tensor at a time, however large the model.
``engine.pt`` is verified first, as a resume verifies it: the SHA-256 its ``meta.json``
records (streamed), or, without one, the checksum sealed inside.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from superoffload.export.source import (
    Entry,
    Extras,
    alias_groups,
    plan_entries,
    storage_identity,
)
from superoffload.runtime import engine_checkpoint as single
from superoffload.runtime.ckpt_files import CheckpointCorrupt, check_seal
from superoffload.runtime.ckpt_manifest import damaged


def load_mapped(file: str) -> dict[str, Any]:
    """``torch.load`` of ``file`` memory-mapped, tensors and plain data only."""
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointCorrupt(f"{file} cannot be read as a checkpoint ({exc})") from exc
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(f"{file} holds a {type(payload).__name__}, not a checkpoint")
    return payload


def check_format(payload: dict[str, Any], file: str, how: str) -> None:
    """The payload is an engine state dict, else an error naming what it is and ``how`` the
    file was expected to be written."""
    found = payload.get("format")
    if found == single.ENGINE_FORMAT and isinstance(payload.get("state"), dict):
        return
    if found is None and "param_groups" in payload and "state" in payload:
        what = ("a torch.optim state dict (parameters by number, no names, no fp32 masters): "
                "written by another optimizer than the offload engine")
    else:
        what = f"format {found!r}"
    raise single.CheckpointMismatch(
        f"{file} holds {what}; an export reads {single.ENGINE_FORMAT!r}, {how}")


class PayloadSource:
    """An engine state dict, memory-mapped (see the module docstring)."""

    single_file = False

    def __init__(self, payload: dict[str, Any], what: str, *, stem: str = "model",
                 extras: Extras | None = None, rename: Callable[[str], str] = str) -> None:
        self.payload, self.what, self.stem = payload, what, stem
        self._extras = extras or Extras()
        self.rename = rename
        self.state: dict[str, dict[str, Any]] = payload["state"]
        self.model: dict[str, torch.Tensor] = payload["model"]

    def entries(self) -> list[Entry]:
        identity = self._identities()
        groups = alias_groups(self.model, identity.__getitem__)
        missing = sorted(set(self.state) - set(self.model))
        # every trainable parameter is also a model state-dict key
        if missing:
            raise single.CheckpointMismatch(f"{self.what}: parameter(s) {missing[:3]} have "
                                            "fp32 masters but no entry in the model's state")
        return plan_entries(groups, lambda k: tuple(self.model[k].shape),
                            lambda k: self.model[k].dtype, self.state, self.rename)

    def _identities(self) -> dict[str, Any]:
        """Which keys name one tensor: shared storage (tied weights are saved once), or, in a
        checkpoint written before that, a key outside ``named_parameters()`` whose bytes equal
        a parameter's of the same shape and dtype (the tied copy: both were copied from one
        tensor; docs/export.md, "Tied weights")."""
        ident = {k: storage_identity(v) for k, v in self.model.items()}
        params = [s[0] for s in self.payload.get("signature", []) if s[0] in self.model]
        named, grouped = set(params), {ident[p] for p in params}
        for k, v in self.model.items():
            if k in named or ident[k] is None or ident[k] in grouped:
                continue
            for p in params:
                w = self.model[p]
                if w.shape == v.shape and w.dtype == v.dtype and torch.equal(w, v):
                    ident[k] = ident[p]
                    break
        return ident

    def read_master(self, name: str) -> torch.Tensor:
        """One parameter's fp32 master, read from the mapped file."""
        return self.state[name]["master"].to(torch.float32, copy=True)

    def read_other(self, name: str) -> torch.Tensor:
        return self.model[name].clone()

    def extras(self) -> Extras:
        return self._extras

    def close(self) -> None:
        # unmaps the file
        self.payload, self.state, self.model = {}, {}, {}


def open_engine_checkpoint(path: str) -> PayloadSource:
    """A folder written by ``engine.save_checkpoint`` (``engine.pt`` + ``meta.json``),
    verified before anything is read from it."""
    from superoffload.export.companions import run_extras

    file = os.path.join(path, single.FILENAME)
    # the manifest's size and SHA-256, streamed
    reason = damaged(path)
    if reason is not None:
        raise CheckpointCorrupt(f"checkpoint {path}: {reason}; it was not exported. Export an "
                                "older checkpoint, or copy this one again from where it was "
                                "written")
    payload = load_mapped(file)
    if not _sha_recorded(path):
        # no checksum in meta.json: the sealed one alone decides
        check_seal(payload, file)
    check_format(payload, file, "written by engine.save_checkpoint(path)")
    # the storage tier's masters: a file beside engine.pt
    if payload.get("tier") is not None:
        from superoffload.runtime.tier_checkpoint import mapped_states

        payload["state"].update({name: {"master": st.master} for name, st in
                                 mapped_states(path, payload["tier"]).items()})
    shapes = {k: tuple(v.shape) for k, v in payload["model"].items()}
    extras, prefix = run_extras(path, shapes)
    return PayloadSource(payload, f"engine checkpoint {path}", extras=extras,
                         rename=lambda name: name.removeprefix(prefix))


def _sha_recorded(path: str) -> bool:
    """meta.json records engine.pt's SHA-256 (then ``ckpt_manifest.damaged`` has checked it)."""
    try:
        with open(os.path.join(path, single.META)) as f:
            return isinstance(json.load(f)["files"][single.FILENAME]["sha256"], str)
    except (OSError, ValueError, KeyError, TypeError):
        return False
