"""The I/O engine under faults: each one a StorageError naming the file (and the folder, the
offset, the errno), raised in the caller, nothing silently wrong and nothing hung
(docs/storage.md, "I/O engine").

Real faults where this machine allows them: a full file system and a read-only one are small
mounts (tests run as root, where chmod stops nothing; a test skips, saying why, where mount
is refused), a file truncated or deleted under the engine, a descriptor the kernel refuses.
A monkeypatched twin of the mount tests runs everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from superoffload.storage import AioEngine, StorageError, aio_threads, aligned_empty, files
from superoffload.storage.request import IoRequest
from superoffload.storage.ring import (
    ALIGN_BYTES,
    RingCompletion,
    RingOp,
    available_backends,
)

BACKENDS_HERE = available_backends()


@pytest.fixture(params=BACKENDS_HERE)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.contextmanager
def mounted(target: Path, *args: str) -> Iterator[Path]:
    target.mkdir(exist_ok=True)
    try:
        done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused ({done.stderr.strip()}): needs root "
                    "with CAP_SYS_ADMIN")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def test_a_full_disk_fails_at_open_naming_folder_needed_and_free(tmp_path: Path) -> None:
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "none") as folder, \
            AioEngine(backend="threads") as e:
        with pytest.raises(StorageError) as info:
            e.open(folder / "state.bin", 4 << 20)
        err = info.value
        assert err.errno == errno.ENOSPC and err.filename == str(folder / "state.bin")
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        assert f"needs {4 << 20} bytes" in str(err) and str(folder) in str(err)
        assert f"has {free} bytes free" in str(err)
        assert list(folder.iterdir()) == []  # the half-allocated file is gone
        e.open(folder / "fits.bin", 100 << 10)  # the same folder takes what fits


def test_a_full_disk_message_without_a_mount(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "posix_fallocate", full)
    with AioEngine(backend="threads") as e, pytest.raises(StorageError) as info:
        e.open(tmp_path / "state.bin", 10_000)
    assert info.value.errno == errno.ENOSPC
    assert f"needs {3 * ALIGN_BYTES} bytes" in str(info.value)  # rounded up to pages
    assert str(tmp_path) in str(info.value) and "bytes free" in str(info.value)
    assert not (tmp_path / "state.bin").exists()


def test_a_read_only_folder_fails_at_open_naming_it(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with mounted(tmp_path / "ro", "--bind", str(tmp_path / "src")) as folder:
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"remount read-only refused: {done.stderr.strip()}")
        with AioEngine(backend="threads") as e, pytest.raises(StorageError) as info:
            e.open(folder / "state.bin", 1 << 20)
    assert info.value.errno == errno.EROFS
    assert f"the folder {folder} is on a read-only file system" in str(info.value)


def test_a_read_only_folder_message_without_a_mount(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files.os, "open", refused)
    with AioEngine(backend="threads") as e, pytest.raises(StorageError) as info:
        e.open(tmp_path / "state.bin", 1 << 20)
    assert info.value.errno == errno.EROFS and str(tmp_path) in str(info.value)


def test_a_truncated_file_is_an_error_naming_it(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "t.bin"
    with AioEngine(backend=backend) as e:
        file = e.open(path, 1 << 20)
        e.write(file, 0, torch.ones(1 << 20, dtype=torch.uint8)).wait()
        os.truncate(path, 1000)
        with pytest.raises(StorageError, match=f"{path} was truncated under the engine to "
                                               "1000 bytes") as info:
            e.read(file, 0, torch.empty(4096, dtype=torch.uint8))
        assert info.value.errno == errno.EIO


def test_a_short_read_in_flight_is_an_error_never_zeros(tmp_path: Path, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The file ends inside the range while the read is in flight (the check at submit
    passed): the ring's end of file becomes an error naming the file and the offset."""
    path = tmp_path / "short.bin"
    with AioEngine(backend=backend, block_bytes=ALIGN_BYTES * 4) as e:
        file = e.open(path, 1 << 20)
        os.truncate(path, 40_000)
        monkeypatch.setattr(file, "check", lambda: None)  # as if it happened after submit
        out = aligned_empty(1 << 20, pin=False).fill_(7)
        request = e.read(file, 0, out)
        with pytest.raises(StorageError, match="read met the end of the file at offset "
                                               "40000") as info:
            request.wait()
        assert info.value.filename == str(path) and info.value.offset_bytes == 40_000
        assert request.done_bytes == 40_000


def test_a_deleted_file_fails_the_next_request_naming_it(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "gone.bin"
    with AioEngine(backend=backend) as e:
        file = e.open(path, 1 << 20)
        path.unlink()
        with pytest.raises(StorageError, match=f"tier file {path} was deleted") as info:
            e.write(file, 0, torch.ones(10, dtype=torch.uint8))
        assert info.value.errno == errno.ENOENT


@contextlib.contextmanager
def gated_transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The threads backend's blocks wait for the event before they move."""
    gate = threading.Event()
    real = aio_threads.transfer

    def held(*args):  # type: ignore[no-untyped-def]
        gate.wait()
        return real(*args)

    monkeypatch.setattr(aio_threads, "transfer", held)
    try:
        yield gate
    finally:
        gate.set()


def test_a_file_deleted_while_a_write_runs_fails_that_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gone.bin"
    with AioEngine(backend="threads") as e, gated_transfers(monkeypatch) as gate:
        file = e.open(path, 1 << 20)
        request = e.write(file, 0, torch.ones(1 << 20, dtype=torch.uint8))
        path.unlink()  # after the check at submit, before the data lands
        with pytest.raises(TimeoutError, match=f"write of 1048576 bytes at offset 0 of {path}"):
            request.wait(timeout_s=0.05)
        gate.set()
        with pytest.raises(StorageError, match="was deleted while the engine had it open"):
            request.wait()


def test_a_kernel_error_reaches_wait_with_file_offset_and_errno(tmp_path: Path,
                                                                backend: str) -> None:
    path = tmp_path / "ro.bin"
    with AioEngine(backend=backend, block_bytes=ALIGN_BYTES) as e:
        file = e.open(path, 1 << 20)
        read_only = os.open(path, os.O_RDONLY)
        for fd in (file.fd_buffered, file.fd_direct):
            if fd >= 0:
                os.dup2(read_only, fd)  # the kernel refuses a write: EBADF
        os.close(read_only)
        with pytest.raises(StorageError) as info:
            e.write(file, 3 * ALIGN_BYTES, torch.ones(2 * ALIGN_BYTES, dtype=torch.uint8)).wait()
    assert info.value.errno == errno.EBADF
    assert info.value.offset_bytes == 3 * ALIGN_BYTES and info.value.filename == str(path)
    assert f"write of 8192 bytes at offset 12288 of tier file {path} failed" in str(info.value)


def test_a_failed_io_thread_fails_its_requests_and_later_ones(
        tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = AioEngine(backend=backend)
    file = e.open(tmp_path / "x.bin", 1 << 20)
    ring_type = type(e._submitters[0].ring)

    def broken(self, timeout_ms=-1):  # type: ignore[no-untyped-def]
        raise RuntimeError("ring exploded")

    monkeypatch.setattr(ring_type, "run", broken)
    first = e.write(file, 0, torch.ones(100, dtype=torch.uint8))
    with pytest.raises(StorageError, match="the I/O thread failed: RuntimeError") as info:
        first.wait(timeout_s=30)
    assert isinstance(info.value.__cause__, RuntimeError)
    later = e.read(file, 0, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(StorageError, match="failed earlier"):
        later.wait(timeout_s=30)
    e.close()  # both failures were seen by wait: nothing left to raise


def test_close_raises_a_failure_nobody_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    e = AioEngine(backend="threads")
    file = e.open(path, 1 << 20)
    os.truncate(file.fd_buffered, 0)  # nothing to read, and the check at submit bypassed:
    file.check = lambda: None  # type: ignore[method-assign]
    e.read(file, 0, torch.empty(100, dtype=torch.uint8))  # fails, never waited for
    with pytest.raises(StorageError, match="read met the end of the file"):
        e.close()
    e.close()  # said once


def test_a_request_error_names_the_end_of_file_from_the_ring(tmp_path: Path) -> None:
    """The outcome of a part is decided in one place for every backend: a completion that
    met the end of the file is an error, whatever bytes came before it."""
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * ALIGN_BYTES)
    file = files.TierFile(path, ALIGN_BYTES, os.open(path, os.O_RDWR), -1)
    seen: list[IoRequest] = []
    request = IoRequest(file, 0, torch.empty(ALIGN_BYTES, dtype=torch.uint8), is_write=False,
                        parts=1, on_finish=seen.append)
    op = RingOp(-1, file.fd_buffered, False, 0, 0, ALIGN_BYTES, tag=0)
    request.part_finished(op, RingCompletion(0, 100, 0, end_of_file=True, error_offset=100))
    with pytest.raises(StorageError, match="read met the end of the file at offset 100"):
        request.wait()
    assert seen == [request] and request.done_bytes == 100
    file.close()


def test_fsync_waits_for_the_files_writes_before_syncing(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The write is held until someone waits for it: fsync must wait (and so open the gate)
    before it syncs, else it syncs a file whose write has not landed."""
    from superoffload.storage import aio

    seen: list[bool] = []
    with AioEngine(backend="threads") as e, gated_transfers(monkeypatch) as gate:
        file = e.open(tmp_path / "f.bin", 1 << 20)
        request = e.write(file, 0, torch.ones(1 << 20, dtype=torch.uint8))
        real_wait = IoRequest.wait

        def wait_opens_the_gate(self, timeout_s=None):  # type: ignore[no-untyped-def]
            gate.set()
            return real_wait(self, timeout_s)

        monkeypatch.setattr(IoRequest, "wait", wait_opens_the_gate)
        monkeypatch.setattr(aio.os, "fsync", lambda fd: seen.append(request.done()))
        e.fsync(file)
    assert seen == [True]
