"""Sharded checkpoints of ZeroOffloadEngine: one file per rank plus a manifest.

Layout of ``path/``::

    rank00000-of-00002.pt   this rank's segments: (parameter, offset, master, exp_avg,
    rank00001-of-00002.pt   exp_avg_sq) as fp32 CPU tensors, and its RNG states; rank 0's
                            file also holds the replicated tail buckets' state, the model's
                            other tensors (buffers, frozen parameters) and ``extra``
    manifest.json           format, world size, file names, iteration, config, parameter
                            signature, step counts, param groups, loss scaler, STV, counters

Each file is sealed with a checksum of its contents, written to a temporary name, fsynced
and renamed (runtime/ckpt_files.py); rank 0 writes the manifest, with every file's SHA-256,
only after every rank's file is in place (the checksums' all-gather is the barrier), so a
manifest means a complete checkpoint and a file from another save (a save killed midway) or
a flipped byte is refused on load, naming the file. Segments are stored by *parameter* offset, not by rank range, so
``consolidate()`` rebuilds each full fp32 tensor by concatenating its pieces in offset
order (checking they tile it exactly) whatever the world size that wrote them, and
``load()`` on any world size lets each rank cut its own new slice out of the full tensors
(resharding). Files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from superoffload.distributed.launch import collective_guard
from superoffload.distributed.zero.transport import ZeroTransport
from superoffload.runtime import checkpoint as single
from superoffload.runtime.ckpt_files import read_verified, write_atomic
from superoffload.runtime.state import ParamState

FORMAT = "superoffload-zero/1"
MANIFEST = "manifest.json"


class ShardedCheckpointable(single.Checkpointable, Protocol):
    """What the sharded format needs of a ZeRO engine (zero/engine.py implements it)."""

    zero: ZeroTransport
    backend: Any

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


def _barrier(engine: ShardedCheckpointable, what: str) -> None:
    flag = torch.ones(1, device=engine.backend.device)
    with collective_guard(f"all_reduce ({what})", engine.zero.grad_group):
        dist.all_reduce(flag, group=engine.zero.grad_group)


def save(engine: ShardedCheckpointable, path: str, *, extra: Any = None,
         lr_scheduler: Any = None) -> str:
    """Write this rank's file; rank 0 then writes the manifest. Collective; returns path."""
    engine.synchronize()
    os.makedirs(path, exist_ok=True)
    st = engine.state
    names = st.names
    segments = [(names[i], off, m, a, s) for i, off, m, a, s in engine.zero.export_segments()]
    payload: dict[str, Any] = {"format": FORMAT, "rank": engine.rank,
                               "world_size": engine.world_size, "segments": segments,
                               "rng": single.rng_state()}
    if engine.rank == 0:
        tails = []
        for buf in engine.zero.tails.values():
            for pos, i in enumerate(buf.bucket.param_indices):
                tails.append((names[i], 0, buf.master[pos].detach().float().cpu().reshape(-1),
                              buf.exp_avg[pos].detach().cpu().reshape(-1),
                              buf.exp_avg_sq[pos].detach().cpu().reshape(-1)))
        payload["segments"] += tails
        trained = {names[i] for i in st.trainable}
        payload["model_rest"] = {k: v.detach().cpu().clone()
                                 for k, v in engine.model.state_dict().items() if k not in trained}
        payload["extra"] = extra
        payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
    error: Exception | None = None
    try:
        sha: str | None = write_atomic(
            payload, os.path.join(path, rank_file(engine.rank, engine.world_size))).sha256
    except Exception as exc:  # every rank learns of it below: none waits for a failed one
        error, sha = exc, None
    digests: list[Any] = [None] * engine.world_size  # also the barrier: every file is in place
    with collective_guard("all_gather_object (checkpoint checksums)", engine.zero.grad_group):
        dist.all_gather_object(digests, sha, group=engine.zero.grad_group)
    if error is not None:
        raise error
    failed = [r for r, d in enumerate(digests) if d is None]
    if failed:
        raise OSError(f"sharded checkpoint {path}: rank(s) {failed} could not write their file "
                      "(see their logs); the previous manifest, if any, still names a complete "
                      "checkpoint")
    if engine.rank == 0:
        files = [rank_file(r, engine.world_size) for r in range(engine.world_size)]
        manifest = {
            "format": FORMAT, "world_size": engine.world_size, "files": files,
            "sha256": dict(zip(files, digests)),
            **single.common_payload(engine),
            "steps": {names[i]: st.steps[i] for i in st.trainable},
        }
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(path, MANIFEST))
    _barrier(engine, "checkpoint manifest written")
    return path


@dataclass(frozen=True, slots=True)
class ConsolidatedState:
    """A sharded checkpoint put back together (any world size)."""

    manifest: dict[str, Any]
    states: dict[str, ParamState]
    """Full fp32 master, moments and step per trainable parameter."""
    model_rest: dict[str, torch.Tensor]
    """The model's other state-dict entries (buffers, frozen or tied-alias parameters)."""
    rng: list[Any]
    """Each writing rank's RNG states, by rank."""
    extra: Any
    lr_scheduler: Any = None
    """The LR scheduler's state_dict, when one was saved."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One fp32 state dict: the master weights plus the model's other entries."""
        out = dict(self.model_rest)
        out.update({n: s.master for n, s in self.states.items()})
        return out


def consolidate(path: str) -> ConsolidatedState:
    """Read every rank's file of the checkpoint at ``path`` and rebuild full fp32 tensors."""
    man_path = os.path.join(path, MANIFEST)
    if not os.path.exists(man_path):
        if os.path.exists(os.path.join(path, single.FILENAME)):
            raise FileNotFoundError(
                f"{path} holds a single-process checkpoint ({single.FILENAME}, written by "
                f"OffloadEngine), not a sharded one ({MANIFEST} and one file per rank): load it "
                "with superoffload.initialize(...).load_checkpoint(path)")
        raise FileNotFoundError(f"no sharded checkpoint at {path} ({MANIFEST} is missing: the "
                                "save did not finish, or this is not a ZeRO checkpoint)")
    with open(man_path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise single.CheckpointMismatch(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    rng: list[Any] = []
    model_rest: dict[str, torch.Tensor] = {}
    extra = scheduler = None
    for r, name in enumerate(manifest["files"]):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise FileNotFoundError(f"sharded checkpoint {path}: {name} (rank {r} of "
                                    f"{manifest['world_size']}) is missing; copy every rank's file")
        # the manifest's checksum: a corrupt file, or one from another save, is refused
        payload = read_verified(file, sha256=manifest.get("sha256", {}).get(name))
        if payload["rank"] != r or payload["world_size"] != manifest["world_size"]:
            raise single.CheckpointMismatch(f"{name}: holds rank {payload['rank']} of "
                                            f"{payload['world_size']}, the manifest expects {r}")
        rng.append(payload["rng"])
        for pname, off, m, a, s in payload["segments"]:
            pieces.setdefault(pname, []).append((int(off), m, a, s))
        if r == 0:
            model_rest, extra = payload["model_rest"], payload.get("extra")
            scheduler = payload.get("lr_scheduler")
    states: dict[str, ParamState] = {}
    for pname, shape, _dtype, _trainable in manifest["signature"]:
        if pname not in manifest["steps"]:
            continue
        numel = 1
        for d in shape:
            numel *= int(d)
        parts = sorted(pieces.get(pname, []), key=lambda t: t[0])
        covered = 0
        for off, m, _, _ in parts:
            if off != covered:
                raise single.CheckpointMismatch(
                    f"parameter {pname!r}: elements [{covered}, {off}) are missing or overlap "
                    "in the rank files (a file from another save?)")
            covered += m.numel()
        if covered != numel:
            raise single.CheckpointMismatch(f"parameter {pname!r}: {covered} of {numel} "
                                            "elements found in the rank files")
        master = torch.cat([t[1] for t in parts]).view(shape)
        exp_avg = torch.cat([t[2] for t in parts]).view(shape)
        exp_avg_sq = torch.cat([t[3] for t in parts]).view(shape)
        states[pname] = ParamState(master, exp_avg, exp_avg_sq, int(manifest["steps"][pname]))
    return ConsolidatedState(manifest, states, model_rest, rng, extra, scheduler)


def load(engine: ShardedCheckpointable, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore a checkpoint written by any world size into ``engine``. Collective (every rank
    reads the files it needs; no communication but the final barrier). Returns ``extra``."""
    engine.synchronize()
    cons = consolidate(path)
    man = cons.manifest
    single.check_compatible(engine, man)
    st = engine.state
    engine.restore({i: cons.states[st.names[i]] for i in st.trainable})
    current = engine.model.state_dict()
    with torch.no_grad():
        for k, v in cons.model_rest.items():
            current[k].copy_(v)
    single.restore_common(engine, man)
    if man["world_size"] == engine.world_size:  # same layout: each rank resumes its RNG
        single.set_rng_state(cons.rng[engine.rank])
    if lr_scheduler is not None:
        if cons.lr_scheduler is None:
            raise single.CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
        lr_scheduler.load_state_dict(cons.lr_scheduler)
    _barrier(engine, "checkpoint loaded")
    return cons.extra
