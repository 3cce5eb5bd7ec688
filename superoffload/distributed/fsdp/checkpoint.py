"""Checkpoints of the FSDP2 engine through ``torch.distributed.checkpoint`` (DCP).

``path/`` holds DCP's files (``.metadata``, ``__<rank>_0.distcp``: every trainable
parameter's fp32 master and moments as DTensors of its layout, "state/<name>/master", and
the model's buffers and frozen parameters, "model/<key>"), one sealed file per rank
(``rank00000-of-00002.pt``: its RNG states; rank 0's also ``extra`` and the LR scheduler)
and ``manifest.json`` (format, world size, every file's SHA-256, step counts and
runtime/engine_checkpoint.py's ``common_payload``). A save removes the old manifest first; rank 0
writes the new one after every rank's files are in place (the digests' all-gather is the
barrier), so a manifest means a complete checkpoint, and a flipped byte or a file from
another save is refused naming it. Any world size and mesh loads it (DCP reshards); RNG states
come back on the same world size. A former ZeRO checkpoint (legacy.py) is converted on load.

Buffers (BatchNorm's running statistics) and frozen parameters that are not sharded live on
every rank, and FSDP2 does not keep them equal: each rank's differ. DCP writes one copy of
such a tensor, from whichever rank its planner picks (a resumed rank 0 got rank 1's running
variance). Each rank's own copy goes into its rank file, and comes back to it on the same
world size; DCP's copy is rank 0's (the copy DDP broadcasts), which a load on another world
size and ``consolidate`` give.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from typing import Any, Protocol

import torch
import torch.distributed as dist

from superoffload.distributed.fsdp import legacy
from superoffload.distributed.process_group import collective_guard
from superoffload.kernels.optimizer_batches import is_dtensor
from superoffload.runtime import engine_checkpoint as single
from superoffload.runtime.ckpt_files import (
    CheckpointCorrupt,
    check_digests,
    file_sha256,
    how_to_export,
    read_verified,
    write_atomic,
    write_text_atomic,
)
from superoffload.runtime.engine_state import ParamState

FSDP_FORMAT = "superoffload-fsdp/1"
KINDS = ("master", "exp_avg", "exp_avg_sq")
MANIFEST = legacy.MANIFEST


class FsdpCheckpointable(single.Checkpointable, Protocol):
    """What this format needs of the engine (fsdp_engine.py implements it)."""

    telemetry: Any

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


def _gather(value: Any, what: str) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    with collective_guard(f"all_gather_object ({what})"):
        dist.all_gather_object(out, value)
    return out


def _model_rest(engine: FsdpCheckpointable) -> dict[str, torch.Tensor]:
    """The model's state-dict entries that are not trainable parameters (nor aliases of one,
    such as a tied head): buffers, frozen parameters."""
    trained = {id(engine.state.params[i]) for i in engine.state.trainable}
    return {k: v.detach() for k, v in engine.model.state_dict(keep_vars=True).items()
            if id(v) not in trained}


def _own_rest(engine: FsdpCheckpointable) -> dict[str, torch.Tensor]:
    """This rank's copy of each unsharded buffer and frozen parameter (module docstring)."""
    return {k: v.clone() for k, v in _model_rest(engine).items() if not is_dtensor(v)}


def _dcp_state(engine: FsdpCheckpointable, states: dict[int, ParamState],
               rest: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What DCP saves or fills: "state/<name>/<kind>" and "model/<key>"."""
    out: dict[str, Any] = {f"model/{k}": v for k, v in rest.items()}
    for i, s in states.items():
        out.update((f"state/{engine.state.names[i]}/{k}", getattr(s, k)) for k in KINDS)
    return out


def _state(tensors: dict[str, Any], name: str, step: int) -> ParamState:
    get = [tensors[f"state/{name}/{k}"] for k in KINDS]
    return ParamState(get[0], get[1], get[2], step)


def save_sharded(engine: FsdpCheckpointable, path: str, *, extra: Any = None,
                 lr_scheduler: Any = None) -> str:
    """Write the checkpoint (see the module docstring). Collective; returns ``path``."""
    import torch.distributed.checkpoint as dcp

    engine.synchronize()
    rank, world = engine.rank, engine.world_size
    os.makedirs(path, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(path, MANIFEST)):
        # until the new manifest is written the folder is not a complete checkpoint: a crash
        # mid-save must not leave the old manifest naming new, partial shards
        os.remove(os.path.join(path, MANIFEST))
    st = engine.state
    tensors = _dcp_state(engine, engine.export_states(), _model_rest(engine))
    error: Exception | None = None
    digests: dict[str, str] = {}
    try:
        # one copy of a replicated tensor: rank 0's
        with collective_guard("DCP save"):
            dcp.save(tensors, checkpoint_id=path,
                     planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        payload: dict[str, Any] = {"format": FSDP_FORMAT, "rank": rank, "world_size": world,
                                   "rng": single.rng_state(), "buffers": _own_rest(engine)}
        if rank == 0:
            payload["extra"] = extra
            payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
        name = rank_file(rank, world)
        digests[name] = write_atomic(payload, os.path.join(path, name)).sha256
        for file in sorted(glob.glob(os.path.join(path, f"__{rank}_*.distcp"))):
            digests[os.path.basename(file)] = file_sha256(file)
    except Exception as exc:  # every rank learns of it below: none waits for a failed one
        error = exc
    gathered = _gather(None if error is not None else digests, "checkpoint checksums")
    if error is not None:
        raise error
    failed = [r for r, d in enumerate(gathered) if d is None]
    if failed:
        raise OSError(f"checkpoint {path}: rank(s) {failed} could not write their files (see "
                      "their logs); no manifest was written, so it will not be loaded")
    if rank == 0:
        files = {k: v for d in gathered for k, v in d.items()}
        files[".metadata"] = file_sha256(os.path.join(path, ".metadata"))
        manifest = {"format": FSDP_FORMAT, "world_size": world, "files": sorted(files),
                    "sha256": files, **single.common_payload(engine),
                    "steps": {st.names[i]: st.steps[i] for i in st.trainable},
                    "export": how_to_export()}
        write_text_atomic(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))
        single.log.info("checkpoint saved: %s; export it with %s", path, how_to_export(path))
    _gather(True, "checkpoint manifest written")
    return path


def _verify(path: str, manifest: dict[str, Any]) -> None:
    """Every file the manifest names has the SHA-256 it recorded (DCP's files carry no
    checksum of their own: a flipped byte would load silently)."""
    digests = manifest.get("sha256")
    # a manifest with no checksums cannot vouch for its files: refused, not trusted
    if not isinstance(digests, dict):
        reason: str | None = "its manifest records no checksums"
    else:
        reason = check_digests(path, digests)
    if reason is not None:
        raise CheckpointCorrupt(f"checkpoint {path}: {reason}: it is corrupt, or a file comes "
                                "from another save (a save killed midway leaves a mix); load "
                                "an older checkpoint")


def read_manifest(path: str) -> dict[str, Any]:
    """The checkpoint's manifest, of this format or the former ZeRO one (else refused)."""
    manifest = legacy.read_manifest(path)
    if manifest is not None and manifest.get("format") not in (FSDP_FORMAT, legacy.FORMAT):
        raise single.CheckpointMismatch(f"{path}: format {manifest.get('format')!r}, expected "
                                        f"{FSDP_FORMAT!r}")
    if manifest is None:
        if os.path.exists(os.path.join(path, single.FILENAME)):
            raise FileNotFoundError(
                f"{path} holds a single-process checkpoint ({single.FILENAME}): load it with "
                "superoffload.initialize(...).load_checkpoint(path) in one process, then save "
                "it there; the data-parallel engine loads checkpoints of its own format")
        raise FileNotFoundError(f"no checkpoint at {path} ({MANIFEST} is missing: the save did "
                                "not finish, or this is not a superoffload checkpoint)")
    return manifest


def load_sharded(engine: FsdpCheckpointable, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore a checkpoint written on any world size (or by the former ZeRO engine: it is
    converted). Collective; returns ``extra``."""
    engine.synchronize()
    manifest = read_manifest(path)
    if manifest.get("format") == legacy.FORMAT:
        return _load_legacy(engine, path, manifest, lr_scheduler)
    single.check_compatible(engine, manifest)
    _verify(path, manifest)
    import torch.distributed.checkpoint as dcp

    st = engine.state
    # DTensors of this run's layout: DCP fills them in place
    current = engine.export_states()
    rest = {k: v.detach().clone() for k, v in _model_rest(engine).items()}
    targets = _dcp_state(engine, current, rest)
    with collective_guard("DCP load"):
        dcp.load(targets, checkpoint_id=path)
    engine.restore({i: _state(targets, st.names[i], int(manifest["steps"][st.names[i]]))
                    for i in current})
    n = manifest["world_size"]
    first = read_verified(os.path.join(path, rank_file(0, n)))
    mine = None
    # same layout: each rank resumes its RNG and its buffers
    if n == engine.world_size:
        # rank 0's file was read (and verified) already
        mine = first
        if engine.rank != 0:
            mine = read_verified(os.path.join(path, rank_file(engine.rank, n)))
        single.set_rng_state(mine["rng"])
    # none: saved before they were
    own = mine.get("buffers", {}) if mine is not None else {}
    _copy_model_rest(engine, {k: own.get(k, targets[f"model/{k}"]) for k in rest})
    single.restore_common(engine, manifest)
    _load_scheduler(lr_scheduler, first.get("lr_scheduler"))
    _gather(True, "checkpoint loaded")
    return first.get("extra")


def consolidate(path: str) -> legacy.ConsolidatedState:
    """Every full fp32 tensor of the checkpoint at ``path`` (this format or the former ZeRO
    one), read in this process alone (no process group: a notebook, a conversion script).
    ``.state_dict()`` of the result is one fp32 state dict of the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = read_manifest(path)
    if manifest.get("format") == legacy.FORMAT:
        return legacy.consolidate(path, manifest)
    _verify(path, manifest)
    reader = dcp.FileSystemReader(path)
    tensors = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for k, md in reader.read_metadata().state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    # "assuming the intent is to load in a single process": yes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    states = {name: _state(tensors, name, int(step)) for name, step in manifest["steps"].items()}
    rest = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    n = manifest["world_size"]
    files = [read_verified(os.path.join(path, rank_file(r, n))) for r in range(n)]
    return legacy.ConsolidatedState(manifest, states, rest, [f["rng"] for f in files],
                                    files[0].get("extra"), files[0].get("lr_scheduler"))


def _load_legacy(engine: FsdpCheckpointable, path: str, manifest: dict[str, Any],
                 lr_scheduler: Any) -> Any:
    """A former ZeRO checkpoint: consolidate, load full tensors, each rank its shards."""
    cons = legacy.consolidate(path, manifest)
    single.check_compatible(engine, manifest)
    st = engine.state
    engine.restore({i: cons.states[st.names[i]] for i in st.trainable})
    current = _model_rest(engine)
    _copy_model_rest(engine, {k: v for k, v in cons.model_rest.items() if k in current})
    single.restore_common(engine, manifest)
    if manifest["world_size"] == engine.world_size:
        single.set_rng_state(cons.rng[engine.rank])
    _load_scheduler(lr_scheduler, cons.lr_scheduler)
    engine.telemetry.note(engine.iteration, f"converted the former ZeRO checkpoint {path} "
                          "(its next save writes the DCP format)")
    _gather(True, "checkpoint loaded")
    return cons.extra


def _copy_model_rest(engine: FsdpCheckpointable, values: dict[str, torch.Tensor]) -> None:
    """Write loaded buffers and frozen parameters into the model (a DTensor keeps its own
    layout: a full tensor is cut to this rank's piece)."""
    from torch.distributed.tensor import distribute_tensor

    current = _model_rest(engine)
    with torch.no_grad():
        for k, v in values.items():
            t = current[k]
            if is_dtensor(t) and not is_dtensor(v):
                mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
                v = distribute_tensor(v.to(t.dtype), mesh, placements, src_data_rank=None)
            if is_dtensor(t):
                t.to_local().copy_(v.to_local())  # type: ignore[attr-defined]
            else:
                t.copy_(v)


def _load_scheduler(lr_scheduler: Any, state: Any) -> None:
    if lr_scheduler is None:
        return
    if state is None:
        raise single.CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
    lr_scheduler.load_state_dict(state)
