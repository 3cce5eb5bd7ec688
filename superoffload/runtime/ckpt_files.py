"""Checkpoint files: atomic writes, checksums verified on load, orphans cleaned
(docs/failure_semantics.md, "Resume").

Every checkpoint file (``engine.pt``; ZeRO's ``rankNNNNN-of-NNNNN.pt``) is

* **sealed**: before writing, the payload gets an ``integrity`` entry — a SHA-256 over a
  canonical form of everything in it, each tensor by dtype, shape and the SHA-256 of its
  bytes. It lives inside the file, so it is atomic with the data: ``read_verified``
  recomputes it and a flipped byte in a tensor (which ``torch.load`` loads silently) or in
  the metadata is an error naming the file and the entry;
* **hashed**: the SHA-256 of the file's bytes, computed while writing, goes into the folder's
  manifest (``meta.json``, ZeRO's ``manifest.json``) so tools can check files without
  PyTorch, and a file from another save (a mix of two saves) is refused naming both;
* **read with care**: only a regular file is read (a link to ``/dev/zero`` would be read
  without end, a FIFO would block), only when its size is one its manifest allows, and
  only tensors and plain data are unpickled (``weights_only=True``): a file carrying pickled
  objects is refused as not ours, without advice to switch the check off;
* **atomic**: written to ``<name>.tmp-<pid>-<n>`` (unique per save, so two threads saving
  into one folder never share a temporary), fsynced, renamed (POSIX rename is atomic), so
  a killed write leaves the previous file. The next save removes temporaries that no live
  process on this host is writing (a save killed with SIGKILL leaves one behind).

A full disk, a file-size limit, Ctrl-C: torch.save reports any exception raised by a write
of a file object as ``[enforce fail at inline_container.cc] unexpected pos``, losing it. The
writer keeps it and the save raises it: ``KeyboardInterrupt`` as itself, an OS error named
(ckpt_size.py: "no space left on device", "file size limit exceeded", with the bytes the file
needs); a save that cannot fit is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import pickle
import re
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.runtime.ckpt_size import FileSize, check_room, write_error

SEAL_KEY = "integrity"

# next() on a count is atomic under the GIL
_serial = itertools.count()
_writing: set[str] = set()
"""Temporaries this process is writing now (``clean_orphans`` leaves them alone)."""
_writing_lock = threading.Lock()
_folder_locks: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class CheckpointCorrupt(ValueError):
    """A checkpoint file is not what it should be, and nothing was loaded from it: its
    contents do not match their checksum, it is not a regular file, it is not the file its
    manifest describes, or it is not a superoffload checkpoint at all."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    sha256: str
    nbytes: int


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it and keeps the exception of a
    failed write (torch.save replaces it with "unexpected pos")."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        try:
            self.f.write(view)
        except BaseException as exc:  # Ctrl-C lands here too: the signal runs at a write
            self.error = self.error or exc
            raise
        self.h.update(view)
        self.n += len(view)
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
        # written before checksums existed: nothing to check
        return
    h = hashlib.sha256()
    _canonical({k: v for k, v in payload.items() if k != SEAL_KEY}, h)
    if h.hexdigest() != want:
        raise CheckpointCorrupt(
            f"checkpoint file {file} is corrupt: its contents do not match the checksum sealed "
            "in it (a flipped byte on disk or in transit). Load an older checkpoint, or copy "
            "the file again from where it was written")


def temp_path(final: str) -> str:
    """A temporary next to ``final``, unique in this process: ``<final>.tmp-<pid>-<n>``."""
    return f"{final}.tmp-{os.getpid()}-{next(_serial)}"


@contextlib.contextmanager
def writing(tmp: str) -> Iterator[str]:
    """Mark ``tmp`` as being written by this process (``clean_orphans`` skips it); remove
    it when the block fails."""
    with _writing_lock:
        _writing.add(tmp)
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    finally:
        with _writing_lock:
            _writing.discard(tmp)


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """One save at a time into ``folder`` within this process, so the files of a checkpoint
    (``engine.pt`` and ``meta.json``) always come from the same save."""
    key = os.path.realpath(folder)
    with _writing_lock:
        lock = _folder_locks.get(key)
        if lock is None:
            lock = _folder_locks[key] = threading.Lock()
    with lock:
        yield


def write_text_atomic(path: str, text: str) -> None:
    """``text`` into ``path`` through a unique temporary, fsynced, renamed."""
    with writing(temp_path(path)) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def write_atomic(payload: dict[str, Any], final: str, *,
                 before_replace: Callable[[FileDigest], None] | None = None) -> FileDigest:
    """Seal ``payload``, ``torch.save`` it to a temporary name, fsync, rename over ``final``.
    ``before_replace(digest)`` runs once the temporary is complete, before the rename (the
    engine writes its manifest there, so the manifest always names the file in place or the
    one about to replace it). A disk too full for it, or a file-size limit, raises a named
    ``OSError`` (ckpt_size.py; before writing when it cannot fit)."""
    clean_orphans(final)
    sealed = seal(payload)
    size = FileSize.of(sealed)
    check_room(final, size)
    with writing(temp_path(final)) as tmp:
        writer: _HashingWriter | None = None
        try:
            with open(tmp, "wb") as f:
                writer = _HashingWriter(f)
                torch.save(sealed, writer)  # type: ignore[arg-type]  # a write()-only file
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:
            # torch.save turns a failed write into its own error: the OSError the writer kept
            # is the cause to name
            cause = exc
            if writer is not None and writer.error is not None:
                cause = writer.error
            named = write_error(cause, final, size)
            if named is not None:
                raise named from exc
            # what torch.save turned into "unexpected pos"
            if cause is not exc:
                raise cause from exc
            raise
        digest = FileDigest(writer.h.hexdigest(), writer.n)
        if before_replace is not None:
            before_replace(digest)
        # readers see the old file or the new one
        os.replace(tmp, final)
    return digest


def regular_size(file: str) -> int:
    """The size of checkpoint file ``file`` (a link is followed); ``CheckpointCorrupt``
    without opening it when it is not a regular file."""
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint file at {file}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorrupt(
            f"checkpoint file {file} is not a regular file (it is {_kind(st.st_mode)}"
            f"{_link_target(file)}); it was not read. Put the checkpoint's own file there")
    return st.st_size


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _link_target(file: str) -> str:
    if os.path.islink(file):
        return f", a link to {os.path.realpath(file)}"
    return ""


def read_regular(file: str, size: int) -> bytes:
    """The ``size`` bytes of regular file ``file`` (``regular_size``); a file swapped or
    grown since is refused, never read past ``size`` + 1 bytes."""
    # a FIFO must not block
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointCorrupt(f"checkpoint file {file} changed while it was opened; it "
                                    "was not read")
        data = f.read(size + 1)
    if len(data) != size:
        raise CheckpointCorrupt(f"checkpoint file {file} changed while it was read ({len(data)}"
                                f" bytes, {size} expected); it was not loaded")
    return data


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_payload(data: bytes, file: str) -> dict[str, Any]:
    """``torch.load`` of a checkpoint file's bytes, tensors and plain data only
    (``weights_only=True``), and its sealed checksum verified. A pickled object raises
    ``CheckpointCorrupt``: a superoffload checkpoint never holds one, so the file is not
    ours or was tampered with (torch's own message would advise turning the check off)."""
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        what = f"object {found.group(1)}" if found else "object"
        raise CheckpointCorrupt(
            f"checkpoint file {file}: not a superoffload checkpoint, or tampered; it was not "
            f"loaded (it holds a pickled {what}, where a checkpoint holds only tensors and "
            "plain data). Load a checkpoint written by save_checkpoint()") from None
    except Exception as exc:
        raise CheckpointCorrupt(f"checkpoint file {file} cannot be read ({exc}); it is corrupt "
                                "or truncated: load an older checkpoint") from exc
    if not isinstance(payload, dict):
        raise CheckpointCorrupt(f"checkpoint file {file}: not a superoffload checkpoint (it "
                                f"holds a {type(payload).__name__}); it was not loaded")
    check_seal(payload, file)
    return dict(payload)


def read_verified(file: str, *, sha256: str | None = None) -> dict[str, Any]:
    """Load ``file`` (a regular file; tensors and plain data only); check the file's SHA-256
    against ``sha256`` when given (its manifest's: a file from another save is refused) and
    the sealed checksum always."""
    data = read_regular(file, regular_size(file))
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointCorrupt(
            f"checkpoint file {file} does not match the SHA-256 its manifest records: it is "
            "corrupt, or it belongs to another save (a save killed midway leaves a mix). Load "
            "an older checkpoint")
    return load_payload(data, file)


def file_sha256(file: str, chunk_bytes: int = 16 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks (a checkpoint need not fit in memory twice)."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def check_digests(folder: str, digests: Mapping[str, str]) -> str | None:
    """The first file named in ``digests`` (name -> SHA-256 its manifest recorded) that is
    missing or differs, as a short reason; None when every one matches."""
    for name, want in digests.items():
        file = os.path.join(folder, name)
        try:
            # a link to /dev/zero is never read
            regular_size(file)
            got = file_sha256(file)
        except CheckpointCorrupt:
            return f"{name} is not a regular file"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if got != want:
            return f"{name} does not match the SHA-256 its manifest records"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_orphans(final: str) -> list[str]:
    """Remove ``<final>.tmp-<pid>[-<n>]`` files whose writer is gone (killed saves); those
    of live processes, and this process's own saves in progress, are left alone."""
    folder, name = os.path.split(final)
    removed = []
    for entry in os.listdir(folder or "."):
        if not entry.startswith(name + ".tmp-"):
            continue
        path = os.path.join(folder, entry)
        pid = entry[len(name) + len(".tmp-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            # another live process is writing it now
            continue
        with _writing_lock:
            if path in _writing:
                # another thread of this process is writing it now
                continue
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


EXPORT_COMMAND = "python -m superoffload export"
"""The command that turns a checkpoint into a Hugging Face folder (docs/export.md)."""


def how_to_export(path: str = "<this folder>") -> str:
    """What a checkpoint says of itself (``meta.json``, ``manifest.json``, the save's log
    line): how to get its fp32 masters as a Hugging Face folder."""
    return (f"{EXPORT_COMMAND} {path} <out_dir> [--dtype bf16]: a Hugging Face folder "
            "(safetensors, config.json) of the fp32 master weights (docs/export.md)")
