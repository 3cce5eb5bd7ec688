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

import hashlib
import json
import os
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from superoffload.config import NUMERICS_FIELDS, OffloadConfig
from superoffload.runtime.ckpt_files import (
    CheckpointCorrupt,
    FileDigest,
    file_sha256,
    folder_lock,
    load_payload,
    read_regular,
    regular_size,
    write_atomic,
    write_text_atomic,
)
from superoffload.runtime.iteration import EngineStats
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.state import EngineState, ParamState
from superoffload.runtime.stv import AdaptiveSTV

FORMAT = "superoffload-engine/1"
FILENAME = "engine.pt"
META = "meta.json"


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

    def export_states(self) -> dict[int, ParamState]: ...

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
        "config": plain(engine.config.to_dict()),
        "signature": engine.state.signature(),
        "param_groups": param_groups_payload(engine),
        "loss_scaler": engine.scaler.state_dict(),
        "stv": engine.adaptive.state_dict(),
        "stats": engine.stats.as_dict(),
    }


def engine_state_dict(engine: Checkpointable) -> dict[str, Any]:
    engine.synchronize()
    states = engine.export_states()
    names = engine.state.names
    return {
        "format": FORMAT,
        **common_payload(engine),
        "state": {
            names[i]: {"master": s.master, "exp_avg": s.exp_avg,
                       "exp_avg_sq": s.exp_avg_sq, "step": s.step}
            for i, s in states.items()
        },
        "model": _model_state(engine),
    }


def _model_state(engine: Checkpointable) -> dict[str, torch.Tensor]:
    with engine.resident_weights():  # weight-flow: streamed blocks are fetched first
        return {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}


def plain(value: Any) -> Any:
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
    mine = plain(engine.config.to_dict())
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
            raise CheckpointMismatch(f"param group {k}: its parameters differ from the checkpoint's")


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


def load_engine_state_dict(engine: Checkpointable, sd: dict[str, Any]) -> None:
    if sd.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint format {sd.get('format')!r}, expected {FORMAT!r}")
    check_compatible(engine, sd)
    engine.synchronize()
    with engine.resident_weights():  # weight-flow: load into, and re-plan from, real weights
        engine.model.load_state_dict(sd["model"])
        names = engine.state.names
        states = {}
        for i in engine.state.trainable:
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
    payload = engine_state_dict(engine)
    payload["rng"] = rng_state()
    payload["extra"] = extra
    payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, FILENAME)
    with folder_lock(path):  # two threads saving here: both files come from one save
        installed = _read_manifest(path)

        def publish(digest: FileDigest) -> None:  # the new file is complete, not yet renamed
            meta: dict[str, Any] = {
                "format": FORMAT, "iteration": engine.iteration, "config": payload["config"],
                "parameters": len(payload["signature"]),
                "files": {FILENAME: {"sha256": digest.sha256, "bytes": digest.nbytes}}}
            if installed is not None and os.path.exists(final):
                meta["replaces"] = installed.this.to_dict()
            write_text_atomic(os.path.join(path, META), json.dumps(meta, indent=2))

        write_atomic(payload, final, before_replace=publish)
    return final


def load(engine: Checkpointable, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore everything saved by ``save`` (checksums verified); returns its ``extra``."""
    file = os.path.join(path, FILENAME)
    if not os.path.lexists(file):
        if os.path.exists(os.path.join(path, "manifest.json")):  # distributed/fsdp/checkpoint.py
            raise CheckpointMismatch(
                f"{path} holds a sharded checkpoint (manifest.json and every rank's files, "
                "written by the data-parallel engine under torchrun), not engine.pt: load it "
                "with superoffload.distributed.fsdp.FsdpOffloadEngine(...).load_checkpoint(path) "
                "(any world size; so.initialize under torchrun builds one), or read its full fp32 "
                "weights with superoffload.distributed.fsdp.consolidate(path).state_dict()")
        raise FileNotFoundError(f"no checkpoint at {file}")
    payload = _read_checked(path)
    load_engine_state_dict(engine, payload)
    set_rng_state(payload["rng"])
    if lr_scheduler is not None:
        if payload.get("lr_scheduler") is None:
            raise CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
        lr_scheduler.load_state_dict(payload["lr_scheduler"])
    return payload.get("extra")


def damaged(path: str) -> str | None:
    """Why the checkpoint at ``path`` is not whole, in a few words; None when its file is the
    one ``meta.json`` describes (or the one that save replaces: a save stopped before its
    rename), or when no manifest was written (nothing to check without loading it)."""
    file = os.path.join(path, FILENAME)
    try:
        size = regular_size(file)
    except FileNotFoundError:
        return f"{FILENAME} is missing"
    except CheckpointCorrupt:
        return f"{FILENAME} is not a regular file"
    manifest = _read_manifest(path)
    if manifest is None:
        return None
    if not manifest.by_size(size):
        return f"{FILENAME} has {size:,} bytes, {META} records {manifest.sizes()}"
    try:
        sha = file_sha256(file)
    except OSError as exc:
        return f"{FILENAME} cannot be read ({exc.strerror or exc})"
    if manifest.by_sha(sha) is None:
        return f"{FILENAME} does not match the SHA-256 its {META} records"
    return None


@dataclass(frozen=True, slots=True)
class Recorded:
    """One save's file as ``meta.json`` records it."""

    digest: FileDigest
    iteration: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.digest.sha256, "bytes": self.digest.nbytes,
                "iteration": self.iteration}

    def describe(self) -> str:
        it = "?" if self.iteration is None else self.iteration
        return f"iteration {it}, {self.digest.nbytes:,} bytes, SHA-256 {self.digest.sha256[:12]}"


@dataclass(frozen=True, slots=True)
class Manifest:
    """``meta.json``: the save it describes (``this``) and the file that save replaces."""

    this: Recorded
    replaces: Recorded | None

    def records(self) -> list[Recorded]:
        return [r for r in (self.this, self.replaces) if r is not None]

    def by_size(self, size: int) -> list[Recorded]:
        return [r for r in self.records() if r.digest.nbytes in (size, -1)]

    def by_sha(self, sha: str) -> Recorded | None:
        return next((r for r in self.records() if r.digest.sha256 == sha), None)

    def sizes(self) -> str:
        return " or ".join(f"{r.digest.nbytes:,} bytes" for r in self.records())


def _read_manifest(path: str) -> Manifest | None:
    """``meta.json``'s records, or None (no meta.json, or one written before checksums)."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        entry = meta["files"][FILENAME]
        this = Recorded(FileDigest(str(entry["sha256"]), int(entry.get("bytes", -1))),
                        meta.get("iteration"))
        old = meta.get("replaces")
        replaces = None if old is None else Recorded(
            FileDigest(str(old["sha256"]), int(old["bytes"])), old.get("iteration"))
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return Manifest(this, replaces)


def _read_checked(path: str) -> dict[str, Any]:
    """``engine.pt``'s payload, refused unless it is a regular file that ``meta.json``
    describes (module docstring); without a manifest its sealed checksum alone decides."""
    file, meta = os.path.join(path, FILENAME), os.path.join(path, META)
    size = regular_size(file)
    manifest = _read_manifest(path)
    if manifest is None:
        return load_payload(read_regular(file, size), file)
    if not manifest.by_size(size):
        raise CheckpointCorrupt(
            f"{file} is not the file {meta} describes ({manifest.this.describe()}): it has "
            f"{size:,} bytes, so it was copied in from another save or is truncated; it was "
            f"not read. Copy that save's {META} along with it, or load an older checkpoint")
    data = read_regular(file, size)
    sha = hashlib.sha256(data).hexdigest()
    found = manifest.by_sha(sha)
    if found is manifest.this:
        return load_payload(data, file)
    if found is not None:  # the save meta.json describes stopped before its rename
        warnings.warn(
            f"{meta} describes a save that did not finish ({manifest.this.describe()}): it "
            f"stopped before replacing {file}, which still holds the save before it "
            f"({found.describe()}); loading that one", RuntimeWarning, stacklevel=3)
        return load_payload(data, file)
    payload = load_payload(data, file)  # a flipped byte fails its sealed checksum here
    theirs = Recorded(FileDigest(sha, size), payload.get("iteration"))
    raise CheckpointCorrupt(
        f"{file} is not the file {meta} describes: {META} records {manifest.this.describe()}, "
        f"{FILENAME} holds {theirs.describe()} (its own sealed checksum is intact), a file "
        f"copied in from another save; it was not loaded. Copy that save's {META} along with "
        f"it, or remove {meta} to load {FILENAME} on its sealed checksum alone")
