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
file's SHA-256.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from superoffload.config import NUMERICS_FIELDS, OffloadConfig
from superoffload.runtime.ckpt_files import (
    check_digests,
    folder_lock,
    read_verified,
    write_atomic,
    write_text_atomic,
)
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.scheduler import EngineStats
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
    ``path/meta.json`` (the file's SHA-256, for tools); returns the file path. Nothing is
    created when the engine has failed (the state is gathered first)."""
    payload = engine_state_dict(engine)
    payload["rng"] = rng_state()
    payload["extra"] = extra
    payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, FILENAME)
    with folder_lock(path):  # two threads saving here: both files come from one save
        digest = write_atomic(payload, final)
        meta = {"format": FORMAT, "iteration": engine.iteration, "config": payload["config"],
                "parameters": len(payload["signature"]),
                "files": {FILENAME: {"sha256": digest.sha256, "bytes": digest.nbytes}}}
        write_text_atomic(os.path.join(path, META), json.dumps(meta, indent=2))
    return final


def load(engine: Checkpointable, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore everything saved by ``save`` (checksums verified); returns its ``extra``."""
    file = os.path.join(path, FILENAME)
    if not os.path.exists(file):
        if os.path.exists(os.path.join(path, "manifest.json")):  # zero/checkpoint.MANIFEST
            raise CheckpointMismatch(
                f"{path} holds a sharded checkpoint (manifest.json and one file per rank, "
                "written by ZeroOffloadEngine under torchrun), not engine.pt: load it with "
                "superoffload.distributed.zero.ZeroOffloadEngine(...).load_checkpoint(path) "
                "(any world size), or read its full fp32 weights with "
                "superoffload.distributed.zero.consolidate(path).state_dict()")
        raise FileNotFoundError(f"no checkpoint at {file}")
    # the sealed checksum refuses a corrupt file; meta.json is written after engine.pt, so
    # a save killed between the two leaves it older: that only warns
    payload = read_verified(file, sha256=_recorded_sha256(path), stale_ok=True)
    load_engine_state_dict(engine, payload)
    set_rng_state(payload["rng"])
    if lr_scheduler is not None:
        if payload.get("lr_scheduler") is None:
            raise CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
        lr_scheduler.load_state_dict(payload["lr_scheduler"])
    return payload.get("extra")


def damaged(path: str) -> str | None:
    """Why the checkpoint at ``path`` is not whole, in a few words; None when its file matches
    the SHA-256 ``meta.json`` recorded, or when none was recorded (nothing to check without
    loading it). A file whose digest differs is read in full: a ``meta.json`` older than its
    file (a save killed between the two) still loads."""
    file = os.path.join(path, FILENAME)
    sha = _recorded_sha256(path)
    if sha is None:
        return None if os.path.exists(file) else f"{FILENAME} is missing"
    reason = check_digests(path, {FILENAME: sha})
    if reason is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the older manifest: expected here
            read_verified(file, sha256=sha, stale_ok=True)
    except Exception as exc:
        return f"{reason}, and it does not load ({type(exc).__name__})"
    return None


def _recorded_sha256(path: str) -> str | None:
    try:
        with open(os.path.join(path, META)) as f:
            return str(json.load(f)["files"][FILENAME]["sha256"])
    except (OSError, KeyError, ValueError, TypeError):
        return None  # no meta.json, or one written before checksums existed
