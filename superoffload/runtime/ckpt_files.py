"""Checkpoint files: atomic writes, checksums verified on load, orphans cleaned (issue 12).

Every checkpoint file (``engine.pt``; ZeRO's ``rankNNNNN-of-NNNNN.pt``) is

* **sealed**: before writing, the payload gets an ``integrity`` entry — a SHA-256 over a
  canonical form of everything in it, each tensor by dtype, shape and the SHA-256 of its
  bytes. It lives inside the file, so it is atomic with the data: ``read_verified``
  recomputes it and a flipped byte in a tensor (which ``torch.load`` loads silently) or in
  the metadata is an error naming the file and the entry;
* **hashed**: the SHA-256 of the file's bytes, computed while writing, goes into the folder's
  manifest (``meta.json``, ZeRO's ``manifest.json``) so tools can check files without
  PyTorch, and ZeRO refuses a rank file from another save (a mix of two saves);
* **atomic**: written to ``<name>.tmp-<pid>``, fsynced, renamed (POSIX rename is atomic), so
  a killed write leaves the previous file. The next save removes temporaries that no live
  process on this host is writing (a save killed with SIGKILL leaves one behind).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SEAL_KEY = "integrity"


class CheckpointCorrupt(ValueError):
    """A checkpoint file's contents do not match their checksum."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    sha256: str
    nbytes: int


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.h.update(view)
        self.n += len(view)
        self.f.write(view)
        return len(view)


def _canonical(value: Any, h: Any) -> None:
    """Feed ``value`` into hash ``h`` in a canonical, type-tagged form."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).digest())
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            _canonical(key, h)
            _canonical(value[key], h)
    elif isinstance(value, (list, tuple)):
        h.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
        for item in value:
            _canonical(item, h)
    else:
        h.update(f"V{type(value).__name__}:{value!r};".encode())


def seal(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with its ``integrity`` checksum (computed over everything else)."""
    h = hashlib.sha256()
    _canonical({k: v for k, v in payload.items() if k != SEAL_KEY}, h)
    return {**payload, SEAL_KEY: h.hexdigest()}


def check_seal(payload: Mapping[str, Any], file: str) -> None:
    want = payload.get(SEAL_KEY)
    if want is None:
        return  # written before checksums existed: nothing to check
    h = hashlib.sha256()
    _canonical({k: v for k, v in payload.items() if k != SEAL_KEY}, h)
    if h.hexdigest() != want:
        raise CheckpointCorrupt(
            f"checkpoint file {file} is corrupt: its contents do not match the checksum sealed "
            "in it (a flipped byte on disk or in transit). Load an older checkpoint, or copy "
            "the file again from where it was written")


def write_atomic(payload: dict[str, Any], final: str) -> FileDigest:
    """Seal ``payload``, ``torch.save`` it to a temporary name, fsync, rename over ``final``."""
    clean_orphans(final)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(seal(payload), writer)  # type: ignore[arg-type]  # a write()-only file
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return FileDigest(writer.h.hexdigest(), writer.n)


def read_verified(file: str, *, sha256: str | None = None,
                  stale_ok: bool = False) -> dict[str, Any]:
    """Load ``file`` (tensors and plain data only: ``weights_only=True``); check the file's
    SHA-256 against ``sha256`` when given and the sealed checksum always. ``stale_ok``: a
    SHA-256 that differs while the sealed checksum passes only warns (one file whose
    manifest is written after it, and may be from the previous save)."""
    if not os.path.exists(file):
        raise FileNotFoundError(f"no checkpoint file at {file}")
    with open(file, "rb") as f:
        data = f.read()
    digest_ok = sha256 is None or hashlib.sha256(data).hexdigest() == sha256
    if not digest_ok and not stale_ok:
        raise CheckpointCorrupt(
            f"checkpoint file {file} does not match the SHA-256 its manifest records: it is "
            "corrupt, or it belongs to another save (a save killed midway leaves a mix). Load "
            "an older checkpoint")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise  # weights_only refused an object: not corruption, a file that is not ours
    except Exception as exc:
        raise CheckpointCorrupt(f"checkpoint file {file} cannot be read ({exc}); it is corrupt "
                                "or truncated: load an older checkpoint") from exc
    check_seal(payload, file)
    if not digest_ok:  # the file is whole: its manifest is from an older save
        warnings.warn(f"the manifest beside {file} is older than the file (a save killed "
                      "between writing the two; their checksums differ, the checkpoint itself "
                      "checks out)", RuntimeWarning, stacklevel=3)
    return dict(payload)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_orphans(final: str) -> list[str]:
    """Remove ``<final>.tmp-<pid>`` files whose writer is gone (killed saves)."""
    folder, name = os.path.split(final)
    removed = []
    for entry in os.listdir(folder or "."):
        if not entry.startswith(name + ".tmp-"):
            continue
        pid = entry.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue  # another live process is writing it now
        path = os.path.join(folder, entry)
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
