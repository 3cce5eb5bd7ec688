"""Checkpoint-corruption helpers shared by the checkpoint tests (test_reliability.py,
test_fsdp_checkpoint_integrity.py)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path


def flip_tensor_byte(file: Path) -> None:
    """Flip one bit in the middle of the file's largest tensor record (torch.save writes an
    uncompressed zip: local header of 30 bytes + name + extra field, then the data)."""
    with zipfile.ZipFile(file) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(file, "r+b") as f:
        f.seek(info.header_offset + 26)
        n, extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + n + extra + info.file_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
