"""Checkpoints: everything needed for a bit-identical resume, written atomically.

Contents: fp32 master weights, both moments and step counts (per parameter, placement-free
so a checkpoint loads under another ``ratio``/``bucket_bytes``), the model's own weights
and buffers, param-group hyperparameters (the LR a scheduler set), loss scaler, adaptive
STV state, counters, RNG states (torch, CUDA, Python, NumPy) and an optional LR scheduler
and ``extra`` payload.

Safety: one file, ``engine.pt``, written to a temporary name, fsynced, then renamed over the
old one (``os.replace`` is atomic on POSIX), so a write killed midway leaves the previous
checkpoint loadable. Loading uses ``torch.load(weights_only=True)``: tensors and plain data
only, never arbitrary unpickling. ``meta.json`` beside it is for humans and tools.
"""

from __future__ import annotations

import json
import os
import random
from typing import TYPE_CHECKING, Any

import torch

from superoffload.config import OffloadConfig
from superoffload.runtime.state import ParamState

if TYPE_CHECKING:
    from superoffload.runtime.engine import OffloadEngine

FORMAT = "superoffload-engine/1"
FILENAME = "engine.pt"
META = "meta.json"

# Settings that only place or schedule work; a checkpoint may be loaded under other values.
PLACEMENT_FIELDS = frozenset({
    "device", "bucket_bytes", "ratio", "speculation", "rollback", "adaptive_window",
    "adaptive_threshold", "grad_cast", "param_cast", "cpu_threads", "cpu_cores_frac",
    "pin_memory", "prefetch_depth", "weights", "watchdog_s", "telemetry", "telemetry_max_events", "extra",
})


class CheckpointMismatch(ValueError):
    """The checkpoint belongs to another model or configuration."""


def _signature(engine: OffloadEngine) -> list[list[Any]]:
    # shapes recorded at construction: weight-flow's released parameters hold 0 elements
    return [[n, list(shape), str(p.dtype), bool(p.requires_grad)]
            for n, p, shape in zip(engine._names, engine._params, engine._shapes)]


def engine_state_dict(engine: OffloadEngine) -> dict[str, Any]:
    engine.synchronize()
    states = engine._export_states()
    groups = []
    for g in engine.optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        hyper["params"] = [engine._names[engine._index[id(p)]] for p in g["params"]]
        groups.append(hyper)
    return {
        "format": FORMAT,
        "iteration": engine.iteration,
        "config": _plain(engine.config.to_dict()),
        "signature": _signature(engine),
        "param_groups": groups,
        "state": {
            engine._names[i]: {"master": s.master, "exp_avg": s.exp_avg,
                               "exp_avg_sq": s.exp_avg_sq, "step": s.step}
            for i, s in states.items()
        },
        "model": _model_state(engine),
        "loss_scaler": engine.scaler.state_dict(),
        "stv": engine.adaptive.state_dict(),
        "stats": {k: getattr(engine.stats, k) for k in engine.stats.__slots__},  # type: ignore[attr-defined]
    }


def _model_state(engine: OffloadEngine) -> dict[str, torch.Tensor]:
    with engine.resident_weights():  # weight-flow: streamed blocks are fetched first
        return {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}


def _plain(value: Any) -> Any:
    """JSON-safe plain data (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def check_compatible(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model or numerics-relevant config, naming the mismatch."""
    if sd.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint format {sd.get('format')!r}, expected {FORMAT!r}")
    theirs = {s[0]: s for s in sd["signature"]}
    ours = {s[0]: s for s in _signature(engine)}
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
    mine = _plain(engine.config.to_dict())
    for key, value in sd["config"].items():
        if key not in PLACEMENT_FIELDS and mine.get(key) != value:
            raise CheckpointMismatch(
                f"config field {key!r}: checkpoint has {value!r}, this engine has {mine.get(key)!r}"
            )
    if len(sd["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointMismatch(
            f"param groups: checkpoint has {len(sd['param_groups'])}, engine has "
            f"{len(engine.optimizer.param_groups)}"
        )
    for k, (g_ck, g) in enumerate(zip(sd["param_groups"], engine.optimizer.param_groups)):
        names = [engine._names[engine._index[id(p)]] for p in g["params"]]
        if g_ck["params"] != names:
            raise CheckpointMismatch(f"param group {k}: its parameters differ from the checkpoint's")


def load_engine_state_dict(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    check_compatible(engine, sd)
    engine.synchronize()
    engine._reset_iteration()
    with engine.resident_weights():  # weight-flow: load into, and re-plan from, real weights
        _load_model_and_state(engine, sd)


def _load_model_and_state(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    engine.model.load_state_dict(sd["model"])
    for g_ck, g in zip(sd["param_groups"], engine.optimizer.param_groups):
        for key, value in g_ck.items():
            if key != "params":
                g[key] = tuple(value) if key == "betas" else value
    states = []
    for i in engine._trainable:
        s = sd["state"][engine._names[i]]
        states.append(ParamState(s["master"].float(), s["exp_avg"].float(),
                                 s["exp_avg_sq"].float(), int(s["step"])))
    engine._build(engine.config, states)
    engine.scaler.load_state_dict(sd["loss_scaler"])
    engine.adaptive.load_state_dict(sd["stv"])
    for key, value in sd["stats"].items():
        setattr(engine.stats, key, value)
    engine.iteration = int(sd["iteration"])


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _plain_random(random.getstate())}
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


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def save(engine: OffloadEngine, path: str, *, extra: Any = None, lr_scheduler: Any = None) -> str:
    """Write ``path/engine.pt`` atomically; returns the file path."""
    os.makedirs(path, exist_ok=True)
    payload = engine_state_dict(engine)
    payload["rng"] = _rng_state()
    payload["extra"] = extra
    payload["lr_scheduler"] = None if lr_scheduler is None else lr_scheduler.state_dict()
    final = os.path.join(path, FILENAME)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    meta = {"format": FORMAT, "iteration": engine.iteration, "config": payload["config"],
            "parameters": len(payload["signature"])}
    meta_tmp = os.path.join(path, META + ".tmp")
    with open(meta_tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_tmp, os.path.join(path, META))
    return final


def load(engine: OffloadEngine, path: str, *, lr_scheduler: Any = None) -> Any:
    """Restore everything saved by ``save``; returns its ``extra``."""
    file = os.path.join(path, FILENAME)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no checkpoint at {file}")
    payload = torch.load(file, map_location="cpu", weights_only=True)
    load_engine_state_dict(engine, payload)
    _set_rng_state(payload["rng"])
    if lr_scheduler is not None:
        if payload.get("lr_scheduler") is None:
            raise CheckpointMismatch("lr_scheduler given but the checkpoint holds none")
        lr_scheduler.load_state_dict(payload["lr_scheduler"])
    return payload.get("extra")


def config_of(path: str) -> OffloadConfig:
    """The OffloadConfig a checkpoint was written with (from its JSON metadata)."""
    with open(os.path.join(path, META)) as f:
        return OffloadConfig.from_dict(json.load(f)["config"])
