"""Checkpoints: everything needed for a bit-identical resume, written atomically.

Contents: fp32 master weights, both moments and step counts (per parameter, placement-free
so a checkpoint loads under another ``ratio``/``bucket_bytes``), the model's own weights
and buffers, param-group hyperparameters (the LR a scheduler set), loss scaler, adaptive
STV state, counters, RNG states (torch, CUDA, Python, NumPy) and an optional LR scheduler
and ``extra`` payload.

Safety (ckpt_files.py): one file, ``engine.pt``, sealed with a checksum of its contents,
written to a temporary name, fsynced, then renamed over the old one (``os.replace`` is atomic
on POSIX), so a write killed midway leaves the previous checkpoint loadable and a flipped
byte is refused on load naming the file. Loading uses ``torch.load(weights_only=True)``:
tensors and plain data only. ``meta.json`` beside it (for humans and tools) records the
file's SHA-256 and size, and those of the file the save replaces (``replaces``): it is
written after the new file is complete and before the rename, so ``engine.pt`` is always
the file it describes or, after a save stopped between the two, the one it replaces. Any
other file (one copied in from another save) is refused, naming both; a file of another
size, or not a regular file (a link to ``/dev/zero``), is refused without reading it.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from superoffload.config import NUMERICS_FIELDS, OffloadConfig
from superoffload.runtime.ckpt_files import (
    CheckpointCorrupt,
    FileDigest,
    folder_lock,
    how_to_export,
    load_payload,
    read_regular,
    regular_size,
    write_atomic,
    write_text_atomic,
)
from superoffload.runtime.ckpt_folder import checkpoint_folder
from superoffload.runtime.ckpt_manifest import (
    ENGINE_FORMAT,
    FILENAME,
    META,
    read_checked,
    read_meta,
)
from superoffload.runtime.engine_state import EngineState, ParamState
from superoffload.runtime.iteration import EngineStats
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_checkpoint import load_tier, prune, save_tier

log = logging.getLogger("superoffload.checkpoint")


class CheckpointMismatch(ValueError):
    """The checkpoint belongs to another model or configuration."""


class Checkpointable(Protocol):
    """What checkpoints read and restore of an engine (runtime/engine.py implements it)."""

    config: OffloadConfig
    state: EngineState
    scaler: LossScaler
    adaptive: AdaptiveSTV
    model: torch.nn.Module
    iteration: int

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def stats(self) -> EngineStats: ...

    def synchronize(self) -> None: ...

    def export_states(self, *, tier: bool = True) -> dict[int, ParamState]: ...

    @property
    def tier(self) -> StateTier | None: ...

    def resident_weights(self) -> Any: ...

    def restore(self, states: Mapping[int, ParamState]) -> None: ...


def param_groups_payload(engine: Checkpointable) -> list[dict[str, Any]]:
    """Hyper-parameters of each param group (the LR a scheduler set), params by name."""
    st, groups = engine.state, []
    for g in engine.optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        hyper["params"] = [st.names[st.index[id(p)]] for p in g["params"]]
        groups.append(hyper)
    return groups


def common_payload(engine: Checkpointable) -> dict[str, Any]:
    """What both checkpoint formats record besides the tensors."""
    return {
        "iteration": engine.iteration,
        "config": plain_data(engine.config.to_dict()),
        "signature": engine.state.signature(),
        "param_groups": param_groups_payload(engine),
        "loss_scaler": engine.scaler.state_dict(),
        "stv": engine.adaptive.state_dict(),
        "stats": engine.stats.as_dict(),
    }


def engine_state_dict(engine: Checkpointable, *, tier: bool = True) -> dict[str, Any]:
    """Everything a resume needs, in memory; ``tier=False``: without the storage tier's
    states (``save`` streams them to a file of their own, runtime/tier_checkpoint.py)."""
    engine.synchronize()
    states = engine.export_states(tier=tier)
    names = engine.state.names
    return {
        "format": ENGINE_FORMAT,
        **common_payload(engine),
        "state": {
            names[i]: {"master": s.master, "exp_avg": s.exp_avg,
                       "exp_avg_sq": s.exp_avg_sq, "step": s.step}
            for i, s in states.items()
        },
        "model": _model_state(engine),
    }


def _model_state(engine: Checkpointable) -> dict[str, torch.Tensor]:
    # weight-flow: streamed blocks are fetched first
    with engine.resident_weights():
        state = engine.model.state_dict(keep_vars=True)
        # a tied weight (a head sharing its embedding) stays one tensor, saved once: an export
        # then writes it once, from its fp32 master (docs/export.md, "Tied weights")
        copies: dict[int, torch.Tensor] = {}
        for v in state.values():
            if id(v) not in copies:
                copies[id(v)] = v.detach().cpu().clone()
        return {k: copies[id(v)] for k, v in state.items()}


def plain_data(value: Any) -> Any:
    """JSON-safe plain data (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def check_signature(engine: Checkpointable, signature: list[list[Any]]) -> None:
    """Refuse a checkpoint of another model, naming the first differing parameter."""
    # "torch.float32" (written before the two formats agreed) reads as "float32"
    theirs = {s[0]: [s[0], s[1], str(s[2]).removeprefix("torch."), s[3]] for s in signature}
    ours = {s[0]: s for s in engine.state.signature()}
    for name in sorted(set(theirs) | set(ours)):
        if name not in ours:
            raise CheckpointMismatch(f"checkpoint has parameter {name!r} that the model lacks")
        if name not in theirs:
            raise CheckpointMismatch(f"model parameter {name!r} is missing from the checkpoint")
        if theirs[name] != ours[name]:
            raise CheckpointMismatch(
                f"parameter {name!r}: checkpoint has shape/dtype/trainable {theirs[name][1:]}, "
                f"model has {ours[name][1:]}"
            )


def check_compatible(engine: Checkpointable, sd: Mapping[str, Any]) -> None:
    """Refuse a checkpoint of another model or numerics-relevant config, naming the mismatch
    (the fields' roles are declared on OffloadConfig: ``config.NUMERICS_FIELDS``)."""
    check_signature(engine, sd["signature"])
    mine = plain_data(engine.config.to_dict())
    for key, value in sd["config"].items():
        if key in NUMERICS_FIELDS and mine.get(key) != value:
            raise CheckpointMismatch(
                f"config field {key!r}: checkpoint has {value!r}, this engine has {mine.get(key)!r}"
            )
    groups = engine.optimizer.param_groups
    if len(sd["param_groups"]) != len(groups):
        raise CheckpointMismatch(
            f"param groups: checkpoint has {len(sd['param_groups'])}, engine has {len(groups)}")
    st = engine.state
    for k, (g_ck, g) in enumerate(zip(sd["param_groups"], groups)):
        names = [st.names[st.index[id(p)]] for p in g["params"]]
        if g_ck["params"] != names:
            raise CheckpointMismatch(
                f"param group {k}: its parameters differ from the checkpoint's")


def restore_common(engine: Checkpointable, sd: Mapping[str, Any]) -> None:
    """Param-group hyper-parameters, loss scaler, STV state, counters, iteration."""
    for g_ck, g in zip(sd["param_groups"], engine.optimizer.param_groups):
        for key, value in g_ck.items():
            if key != "params":
                g[key] = tuple(value) if key == "betas" else value
    engine.scaler.load_state_dict(sd["loss_scaler"])
    engine.adaptive.load_state_dict(sd["stv"])
    for key, value in sd["stats"].items():
        setattr(engine.stats, key, value)
    engine.iteration = int(sd["iteration"])


def load_engine_state_dict(engine: Checkpointable, sd: dict[str, Any],
                           folder: str | None = None) -> None:
    """``folder``: where the checkpoint lies (its storage-tier states are a file there)."""
    if sd.get("format") != ENGINE_FORMAT:
        raise CheckpointMismatch(
            f"checkpoint format {sd.get('format')!r}, expected {ENGINE_FORMAT!r}")
    check_compatible(engine, sd)
    engine.synchronize()
    # weight-flow: load into, and re-plan from, real weights
    with engine.resident_weights():
        engine.model.load_state_dict(sd["model"])
        names = engine.state.names
        states = {}
        if sd.get("tier") is not None:
            if folder is None:
                raise CheckpointMismatch(
                    "this state dict's storage-tier states live in a file beside the "
                    "checkpoint's engine.pt: load it with engine.load_checkpoint(folder)")
            states.update(load_tier(folder, sd["tier"], {n: i for i, n in enumerate(names)}))
        for i in engine.state.trainable:
            if i in states:
                continue
            s = sd["state"][names[i]]
            states[i] = ParamState(s["master"].float(), s["exp_avg"].float(),
                                   s["exp_avg_sq"].float(), int(s["step"]))
        engine.restore(states)
    restore_common(engine, sd)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": _plain_random(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
        kind, keys, pos, has_gauss, gauss = np_state
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    except ImportError:  # numpy is a dependency, but keep the engine usable without it
        pass
    return state


def _plain_random(state: Any) -> Any:
    return [state[0], list(state[1]), state[2]]


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def save(engine: Checkpointable, path: str, *, extra: Any = None, lr_scheduler: Any = None) -> str:
    """Write ``path/engine.pt`` atomically (sealed with its checksum, ckpt_files.py) and
    ``path/meta.json`` (the file's SHA-256 and size, and those of the file it replaces);
    returns the file path. Nothing is created when the engine has failed (the state is
    gathered first)."""
    tier = engine.tier
    payload = engine_state_dict(engine, tier=tier is None)
    payload["rng"] = rng_state()
    payload["extra"] = extra
    payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
    final = os.path.join(path, FILENAME)
    # two threads saving here: both files come from one save; a failed first save leaves none
    with folder_lock(path), checkpoint_folder(path):
        installed = read_meta(path)
        # a copy of the tier's states, streamed: engine.pt names it
        if tier is not None:
            payload["tier"] = save_tier(tier, path, engine.iteration, engine.state.names,
                                        engine.state.steps)

        # the new file is complete, not yet renamed
        def publish(digest: FileDigest) -> None:
            meta: dict[str, Any] = {
                "format": ENGINE_FORMAT, "iteration": engine.iteration, "config": payload["config"],
                "parameters": len(payload["signature"]),
                "files": {FILENAME: {"sha256": digest.sha256, "bytes": digest.nbytes}},
                "export": how_to_export()}
            if tier is not None:
                meta["files"][payload["tier"]["file"]] = {
                    "sha256": payload["tier"]["sha256"], "bytes": payload["tier"]["bytes"]}
            if installed is not None and os.path.exists(final):
                meta["replaces"] = installed.this.to_dict()
            write_text_atomic(os.path.join(path, META), json.dumps(meta, indent=2))

        try:
            write_atomic(payload, final, before_replace=publish)
        except BaseException:
            # engine.pt in place still names its own tier file
            if tier is not None:
                prune(path, keep=_tier_files_named(final))
            raise
        if tier is not None:
            prune(path, keep=[payload["tier"]["file"]])
    log.info("checkpoint saved: %s; export it with %s", final, how_to_export(path))
    return final


def _tier_files_named(final: str) -> list[str]:
    """The storage-tier file the ``engine.pt`` at ``final`` names (none if unreadable)."""
    try:
        payload = load_payload(read_regular(final, regular_size(final)), final)
    except (OSError, CheckpointCorrupt):
        return []
    entry = payload.get("tier")
    # a checkpoint without a storage tier names no file
    if entry is None:
        return []
    return [str(entry["file"])]


def load(engine: Checkpointable, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore everything saved by ``save`` (checksums verified); returns its ``extra``."""
    file = os.path.join(path, FILENAME)
    if not os.path.lexists(file):
        # distributed/fsdp/checkpoint.py
        if os.path.exists(os.path.join(path, "manifest.json")):
            raise CheckpointMismatch(
                f"{path} holds a sharded checkpoint (manifest.json and every rank's files, "
                "written by the data-parallel engine under torchrun), not engine.pt: load it "
                "with superoffload.distributed.fsdp.FsdpOffloadEngine(...).load_checkpoint(path) "
                "(any world size; so.initialize under torchrun builds one), or read its full fp32 "
                "weights with superoffload.distributed.fsdp.consolidate(path).state_dict()")
        raise FileNotFoundError(f"no checkpoint at {file}")
    payload = read_checked(path)
    load_engine_state_dict(engine, payload, folder=path)
    set_rng_state(payload["rng"])
    if lr_scheduler is not None:
        if payload.get("lr_scheduler") is None:
            raise CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
        lr_scheduler.load_state_dict(payload["lr_scheduler"])
    return payload.get("extra")
