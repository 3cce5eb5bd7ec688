"""The storage tier's part of a checkpoint: its buckets' state copied out of the tier file
into a file of the checkpoint, streamed bucket by bucket (memory bounded by one pool slot), and
read back as views of that file (docs/storage.md, "Checkpoints").

``engine.pt`` (runtime/engine_checkpoint.py) holds everything else and, under ``"tier"``, this
file's name, size and SHA-256 and where each parameter's state lies in it. The file is
placement-free like ``engine.pt``'s own states -- per parameter its fp32 master, then both
moments in fp32 -- so the checkpoint loads under another bucket size, ratio, budget, or with
no tier at all. It is a copy, never a link to the tier file the run keeps overwriting; its
name is unique per save (``tier-state-<iteration>-<random>.bin``) and ``engine.pt`` names it,
so a save stopped midway leaves the previous ``engine.pt`` and its own tier file whole. The
files no ``engine.pt`` names any more (the one in place, or the one a stopped save would
have replaced) are deleted after a save.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from superoffload.runtime.ckpt_files import CheckpointCorrupt, file_sha256
from superoffload.runtime.engine_state import ParamState
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_access import loaded

STATE_FILE_PREFIX = "tier-state-"


def save_tier(tier: StateTier, folder: str, iteration: int, names: Sequence[str],
              steps: Sequence[int]) -> dict[str, Any]:
    """Copy every tier bucket's state in force into a new file in ``folder``; returns the
    entry ``engine.pt`` records (file, bytes, sha256, per parameter: offset, numel, step).
    The engine is synchronized (no step in flight)."""
    name = f"{STATE_FILE_PREFIX}{iteration:08d}-{uuid.uuid4().hex[:8]}.bin"
    path = os.path.join(folder, name)
    tmp = path + ".partial"
    h, offset, params = hashlib.sha256(), 0, {}
    try:
        with open(tmp, "wb") as f:
            for b in tier.bucket_ids:
                with loaded(tier, b, write=False) as buf:
                    for pos, index in enumerate(buf.bucket.param_indices):
                        numel = buf.master[pos].numel()
                        params[names[index]] = {"offset": offset, "numel": numel,
                                                "shape": list(buf.master[pos].shape),
                                                "step": int(steps[index])}
                        for t in (buf.master[pos], buf.exp_avg[pos], buf.exp_avg_sq[pos]):
                            data = t.detach().reshape(-1).to(torch.float32).numpy().tobytes()
                            h.update(data)
                            f.write(data)
                            offset += len(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return {"file": name, "bytes": offset, "sha256": h.hexdigest(), "params": params}


def load_tier(folder: str, entry: Mapping[str, Any],
              index_of: Mapping[str, int]) -> dict[int, ParamState]:
    """The states ``save_tier`` wrote, as views of its file (copy-on-write: nothing is read
    into memory until a build copies them into the engine's buffers or its tier), after
    checking the file's size and SHA-256."""
    return {index_of[name]: state for name, state in mapped_states(folder, entry).items()}


def mapped_states(folder: str, entry: Mapping[str, Any]) -> dict[str, ParamState]:
    """``load_tier``'s states by parameter name (an export reads them so, export/)."""
    path = os.path.join(folder, str(entry["file"]))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"{path} is missing: the checkpoint's storage-tier state (the optimizer state of "
            "the buckets kept on the tier) lives in that file beside engine.pt; copy it along "
            "with the checkpoint") from None
    if size != int(entry["bytes"]):
        raise CheckpointCorrupt(f"{path} has {size:,} bytes, engine.pt records "
                                f"{int(entry['bytes']):,}: truncated or from another save")
    if file_sha256(path) != entry["sha256"]:
        raise CheckpointCorrupt(f"{path} does not match the SHA-256 engine.pt records: the "
                                "file is damaged; load an older checkpoint")
    out: dict[str, ParamState] = {}
    if size == 0:
        return out
    # copy-on-write: the file stays as is
    whole = np.memmap(path, dtype=np.float32, mode="c")
    for name, p in entry["params"].items():
        start, n = int(p["offset"]) // 4, int(p["numel"])
        shape = [int(d) for d in p["shape"]]
        parts = [torch.from_numpy(whole[start + k * n:start + (k + 1) * n]).view(shape)
                 for k in range(3)]
        out[name] = ParamState(parts[0], parts[1], parts[2], step=int(p["step"]))
    return out


def prune(folder: str, keep: Sequence[str]) -> None:
    """Delete the tier-state files in ``folder`` not in ``keep`` (module docstring)."""
    for entry in os.scandir(folder):
        if entry.name.startswith(STATE_FILE_PREFIX) and entry.name not in keep:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
