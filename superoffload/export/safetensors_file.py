"""The safetensors file format, written one tensor at a time and read back.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (one entry per
tensor: ``dtype`` code, ``shape`` and ``data_offsets`` [begin, end) into the byte buffer that
follows, plus ``__metadata__``), then the tensors' raw little-endian bytes back to back
(docs/export.md, "The folder"). The header needs only each tensor's dtype and shape, so the
writer puts it down first and then streams every tensor's bytes as the caller hands them
over: it never holds more than the tensor being written, where the ``safetensors`` package's
``save_file`` takes the whole file's tensors at once. ``__metadata__`` carries
``{"format": "pt"}``, which Hugging Face's loader requires. The header is padded with spaces
to a multiple of 8 and, within a file, tensors go by element size (largest first), so every
tensor starts aligned to its element size, as the reference writer arranges it.

The reader (``read_header``, ``read_tensor``) serves this package's GPT loader and checks
(``load_gpt``); it reads one tensor at a time too.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""torch dtype -> the format's dtype code."""
DTYPE_OF_CODE = {code: dtype for dtype, code in CODES.items()}
METADATA = {"format": "pt"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the header says of one tensor (before its bytes exist)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def code_of(dtype: torch.dtype, key: str) -> str:
    try:
        return CODES[dtype]
    except KeyError:
        raise TypeError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store "
                        f"(it stores {', '.join(sorted(str(d) for d in CODES))})") from None


def file_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """The order tensors go into a file: by element size, largest first (stable), so each
    starts aligned to its element size after the 8-byte-aligned header."""
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


def header_bytes(specs: Sequence[TensorSpec]) -> bytes:
    """Length prefix and JSON header for ``specs`` in that order (``file_order``)."""
    header: dict[str, Any] = {"__metadata__": METADATA}
    offset = 0
    for s in specs:
        header[s.key] = {"dtype": code_of(s.dtype, s.key), "shape": list(s.shape),
                         "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    # the reference writer's padding: data starts 8-aligned
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(path: str, specs: Sequence[TensorSpec],
               tensor_of: Callable[[TensorSpec], torch.Tensor]) -> int:
    """Write ``path``: the header of ``specs`` (``file_order``), then each tensor's bytes,
    asking ``tensor_of(spec)`` for one tensor at a time (a CPU tensor of the spec's dtype and
    shape; dropped once written). fsynced; returns the bytes written."""
    # the format is little-endian; torch writes native order
    if sys.byteorder != "little":
        raise RuntimeError("safetensors export needs a little-endian machine")
    written = 0
    with open(path, "wb") as f:
        head = header_bytes(specs)
        f.write(head)
        written += len(head)
        for s in specs:
            t = tensor_of(s)
            if t.dtype != s.dtype or tuple(t.shape) != s.shape or t.device.type != "cpu":
                raise RuntimeError(f"tensor {s.key!r}: got {t.dtype} {tuple(t.shape)} on "
                                   f"{t.device}, the header says {s.dtype} {s.shape} on cpu")
            written += _write_bytes(f, t)
            del t
        f.flush()
        os.fsync(f.fileno())
    return written


def _write_bytes(f: BinaryIO, t: torch.Tensor) -> int:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    # the bytes themselves: no copy (bf16 has no numpy)
    view = flat.view(torch.uint8).numpy()
    f.write(view.data)
    return int(view.nbytes)


@dataclass(frozen=True, slots=True)
class Stored:
    """One tensor as a file's header records it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute file offset of its first byte."""
    end: int


def read_header(path: str) -> tuple[dict[str, Stored], dict[str, str]]:
    """The tensors (by key) and ``__metadata__`` of a safetensors file; ValueError naming the
    file when it is not one."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file (its header length is invalid)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for key, e in header.items():
        begin, end = e["data_offsets"]
        if e["dtype"] not in DTYPE_OF_CODE:
            raise ValueError(f"{path}: tensor {key!r} has dtype {e['dtype']!r}, unknown here")
        out[key] = Stored(key, DTYPE_OF_CODE[e["dtype"]], tuple(e["shape"]), 8 + n + begin,
                          8 + n + end)
    return out, meta


def read_tensor(path: str, stored: Stored) -> torch.Tensor:
    """One tensor of a safetensors file, read into fresh memory."""
    t = torch.empty(stored.shape, dtype=stored.dtype)
    if stored.end > stored.begin:
        buf = t.reshape(-1).view(torch.uint8).numpy()
        with open(path, "rb") as f:
            f.seek(stored.begin)
            if f.readinto(buf.data) != stored.end - stored.begin:
                raise ValueError(f"{path}: tensor {stored.key!r} is truncated")
    return t
