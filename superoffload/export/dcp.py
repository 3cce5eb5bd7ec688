"""Reading a run from an FSDP2 checkpoint (``torch.distributed.checkpoint``, written by the
data-parallel engine under torchrun: distributed/fsdp/checkpoint.py), in one process.

Every file its ``manifest.json`` names is checked against the SHA-256 recorded there first
(DCP's files carry no checksum of their own). Then each tensor is read alone, at its full
shape, whatever world size wrote it: ``dcp.load`` of one key ("state/<name>/master" for a
trainable parameter's fp32 master, "model/<key>" for a buffer or frozen parameter) reads
only that key's pieces from the rank files. The checkpoint holds no alias of a trained
parameter (a tied head is saved once, as its embedding).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from superoffload.export.source import Entry, Extras, plan_entries
from superoffload.runtime import engine_checkpoint as single
from superoffload.runtime.ckpt_files import CheckpointCorrupt, check_digests

MASTER = "state/{}/master"
MODEL = "model/{}"


class DcpSource:
    """An FSDP2/DCP checkpoint folder (see the module docstring)."""

    stem = "model"
    single_file = False

    def __init__(self, path: str, manifest: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from superoffload.export.companions import run_extras

        digests = manifest.get("sha256")
        # a manifest without digests cannot prove the shards intact: refuse, not trust
        reason: str | None = "its manifest records no checksums"
        if isinstance(digests, dict):
            reason = check_digests(path, digests)
        if reason is not None:
            raise CheckpointCorrupt(f"checkpoint {path}: {reason}; it was not exported. Export "
                                    "an older checkpoint, or copy every file of this one again")
        self.path, self.what = path, f"FSDP2 checkpoint {path}"
        self.reader = dcp.FileSystemReader(path)
        meta = self.reader.read_metadata().state_dict_metadata
        self.stored = {k: md for k, md in meta.items() if isinstance(md, TensorStorageMetadata)}
        self.masters = {str(name) for name in manifest["steps"]}
        self.signature = [str(s[0]) for s in manifest["signature"]]
        shapes = {k.removeprefix("model/"): tuple(md.size) for k, md in self.stored.items()
                  if k.startswith("model/")}
        shapes.update({n: tuple(self.stored[MASTER.format(n)].size) for n in self.masters})
        self.shapes = shapes
        self._extras, prefix = run_extras(path, shapes)
        self.prefix = prefix

    def entries(self) -> list[Entry]:
        # parameters in named_parameters() order, then buffers in the order they were saved
        order = [n for n in self.signature if n in self.shapes]
        named = set(order)
        order += [k for k in self.shapes if k not in named]
        return plan_entries([[k] for k in order], self.shapes.__getitem__,
                            lambda k: self.stored[MODEL.format(k)].properties.dtype,
                            dict.fromkeys(self.masters), lambda n: n.removeprefix(self.prefix))

    def _load(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        md = self.stored[key]
        target = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
        # "assuming the intent is to load in a single process"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=self.reader, no_dist=True)
        return target[key]

    def read_master(self, name: str) -> torch.Tensor:
        """One parameter's fp32 master, gathered from every rank's pieces."""
        return self._load(MASTER.format(name)).to(torch.float32)

    def read_other(self, name: str) -> torch.Tensor:
        return self._load(MODEL.format(name))

    def extras(self) -> Extras:
        return self._extras

    def close(self) -> None:
        self.stored = {}


def open_dcp_checkpoint(path: str) -> DcpSource:
    """The FSDP2 checkpoint at ``path`` (its manifest read and every file verified)."""
    from superoffload.distributed.fsdp import legacy
    from superoffload.distributed.fsdp.checkpoint import read_manifest

    manifest = read_manifest(path)
    if manifest.get("format") == legacy.FORMAT:
        raise single.CheckpointMismatch(
            f"{path} is a checkpoint of the former ZeRO engine ({legacy.FORMAT}): load it with "
            "the FSDP2 engine (load_checkpoint converts it) and save it again, then export that")
    return DcpSource(path, manifest)
