"""O_DIRECT where the file system takes it, buffered I/O where it does not, said once
(docs/storage.md, "I/O engine").

Whether a block really bypassed the page cache is read from the kernel (mincore over a
mapping of the file: which of its pages are cached), not from the engine's own flag: on a
disk file system an aligned write through O_DIRECT leaves no page cached, a buffered one
leaves them all. A file system that refuses O_DIRECT is a ramfs mount (tmpfs takes
O_DIRECT since Linux 6.6); the test skips, saying why, where mount is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from superoffload.storage import AioEngine, StorageError, StorageWarning, aligned_empty
from superoffload.storage.ring import ALIGN_BYTES, available_backends

BACKENDS_HERE = available_backends()
PAGE_CACHED_FS = {"tmpfs", "ramfs", "devtmpfs", "shm"}  # their data lives in the cache


@pytest.fixture(params=BACKENDS_HERE)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return kind


def cached_pages(path: Path, offset: int, nbytes: int) -> int:
    """How many pages of the range the page cache holds: mincore over a shared mapping of
    the file (mapping it reads nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    length = offset + nbytes
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec[offset // mmap.PAGESIZE:])


def test_aligned_blocks_bypass_the_page_cache_on_a_disk(tmp_path: Path, backend: str) -> None:
    kind = fs_type(tmp_path)
    if kind in PAGE_CACHED_FS:
        pytest.skip(f"{tmp_path} is on {kind}: every page of it lives in the page cache")
    path = tmp_path / "d.bin"
    n = 64 * ALIGN_BYTES
    with AioEngine(backend=backend, block_bytes=16 * ALIGN_BYTES, direct="on") as e:
        file = e.open(path, 3 * n)
        assert file.direct
        aligned = aligned_empty(n, pin=False).fill_(1)
        e.write(file, 0, aligned).wait()
        e.read(file, 0, aligned).wait()
        assert cached_pages(path, 0, n) == 0  # O_DIRECT: nothing went through the cache
        # the same bytes from a misaligned address cannot go direct: all through the cache
        e.write(file, n, aligned_empty(n + 1, pin=False)[1:].fill_(2)).wait()
        assert cached_pages(path, n, n) == n // mmap.PAGESIZE
    with AioEngine(backend=backend, direct="off") as e:
        file = e.open(path, 3 * n, create=False)
        assert not file.direct
        e.write(file, 2 * n, aligned).wait()
        assert cached_pages(path, 2 * n, n) == n // mmap.PAGESIZE


@contextlib.contextmanager
def ramfs(target: Path) -> Iterator[Path]:
    target.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "ramfs", "none", str(target)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mount -t ramfs refused ({done.stderr.strip()}): needs root with "
                    "CAP_SYS_ADMIN")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def test_a_file_system_without_o_direct_falls_back_once_saying_so(tmp_path: Path,
                                                                   backend: str) -> None:
    with ramfs(tmp_path / "ram") as folder, AioEngine(backend=backend) as e:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # count every warning, not Python's dedup
            first = e.open(folder / "a.bin", 100_000)
            second = e.open(folder / "b.bin", 100_000)
        said = [w for w in caught if issubclass(w.category, StorageWarning)]
        assert len(said) == 1, [str(w.message) for w in said]
        assert str(folder) in str(said[0].message) and "EINVAL" in str(said[0].message)
        assert not first.direct and not second.direct
        data = torch.randint(0, 256, (50_000,), dtype=torch.uint8)
        buf = aligned_empty(50_000, pin=False)
        buf.copy_(data)
        e.write(first, ALIGN_BYTES, buf).wait()
        back = aligned_empty(50_000, pin=False)
        e.read(first, ALIGN_BYTES, back).wait()
        assert torch.equal(back, data)
        strict = AioEngine(backend=backend, direct="on")
        with pytest.raises(StorageError, match=f"direct='on' but the file system of {folder} "
                                               "refuses O_DIRECT"):
            strict.open(folder / "c.bin", 100)
        strict.close()
        assert not (folder / "c.bin").exists()


def test_dev_shm_round_trips_and_warns_only_if_it_falls_back(backend: str) -> None:
    folder = Path("/dev/shm")
    if not folder.is_dir():
        pytest.skip("no /dev/shm here")
    path = folder / f"superoffload-test-{os.getpid()}-{backend}.bin"
    try:
        with AioEngine(backend=backend) as e, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            file = e.open(path, 1 << 20)
            data = aligned_empty(1 << 20, pin=False).random_(0, 256)
            e.write(file, 0, data).wait()
            back = aligned_empty(1 << 20, pin=False)
            e.read(file, 0, back).wait()
            assert torch.equal(back, data)
        said = [w for w in caught if issubclass(w.category, StorageWarning)]
        # tmpfs takes O_DIRECT since Linux 6.6; before, it falls back and says so once
        assert len(said) == (0 if file.direct else 1)
    finally:
        path.unlink(missing_ok=True)
