"""The checkpoint's manifest, ``meta.json``: which ``engine.pt`` it describes (SHA-256 and
size) and the one that save replaces, and the reading of ``engine.pt`` it allows
(runtime/engine_checkpoint.py's module docstring: a file of another size, or not the one described,
is refused without being unpickled).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

from superoffload.runtime.ckpt_files import (
    CheckpointCorrupt,
    FileDigest,
    file_sha256,
    load_payload,
    read_regular,
    regular_size,
)

ENGINE_FORMAT = "superoffload-engine/1"
FILENAME = "engine.pt"
META = "meta.json"


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
    manifest = read_meta(path)
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


def read_meta(path: str) -> Manifest | None:
    """``meta.json``'s records, or None (no meta.json, or one written before checksums)."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        entry = meta["files"][FILENAME]
        this = Recorded(FileDigest(str(entry["sha256"]), int(entry.get("bytes", -1))),
                        meta.get("iteration"))
        old = meta.get("replaces")
        replaces = None
        # the first save of a folder replaces nothing
        if old is not None:
            replaces = Recorded(
                FileDigest(str(old["sha256"]), int(old["bytes"])), old.get("iteration"))
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return Manifest(this, replaces)


def read_checked(path: str) -> dict[str, Any]:
    """``engine.pt``'s payload, refused unless it is a regular file that ``meta.json``
    describes (module docstring); without a manifest its sealed checksum alone decides."""
    file, meta = os.path.join(path, FILENAME), os.path.join(path, META)
    size = regular_size(file)
    manifest = read_meta(path)
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
    # the save meta.json describes stopped before its rename
    if found is not None:
        warnings.warn(
            f"{meta} describes a save that did not finish ({manifest.this.describe()}): it "
            f"stopped before replacing {file}, which still holds the save before it "
            f"({found.describe()}); loading that one", RuntimeWarning, stacklevel=3)
        return load_payload(data, file)
    # a flipped byte fails its sealed checksum here
    payload = load_payload(data, file)
    theirs = Recorded(FileDigest(sha, size), payload.get("iteration"))
    raise CheckpointCorrupt(
        f"{file} is not the file {meta} describes: {META} records {manifest.this.describe()}, "
        f"{FILENAME} holds {theirs.describe()} (its own sealed checksum is intact), a file "
        f"copied in from another save; it was not loaded. Copy that save's {META} along with "
        f"it, or remove {meta} to load {FILENAME} on its sealed checksum alone")
