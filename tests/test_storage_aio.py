"""The storage tier's I/O engine moves the right bytes to the right place (docs/storage.md,
"I/O engine"): round trips at odd sizes, offsets and buffer addresses checked against the
file's bytes read with plain os.pread (a read and a write that both miss by the same
offset would pass a round trip alone), many requests from several threads, a small request
finishing before a large one submitted earlier, and every backend that runs here.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch

from superoffload.storage import AioEngine, aligned_empty, measure_storage
from superoffload.storage.aio import split_request
from superoffload.storage.aio_threads import ThreadRing, block_length
from superoffload.storage.ring import (
    ALIGN_BYTES,
    BACKENDS,
    RingOp,
    available_backends,
    c_engine,
)

BACKENDS_HERE = available_backends()
BLOCK = 64 << 10  # small blocks: a few MiB make many blocks and several rounds of the ring


def _on_disk(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=BACKENDS_HERE)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


# (file offset, bytes, misalignment of the buffer's address): heads, tails, one byte,
# exactly one page, a block plus one byte, a request that starts and ends mid-page
CASES = [
    (0, 1, 0),
    (4095, 2, 0),
    (0, ALIGN_BYTES, 0),
    (ALIGN_BYTES, ALIGN_BYTES + 1, 0),
    (12345, 3 * BLOCK + 777, 0),
    (8 * ALIGN_BYTES, 5 * BLOCK, 0),
    (8 * ALIGN_BYTES, 5 * BLOCK, 1),  # aligned in the file, not in memory: all buffered
    (3 * ALIGN_BYTES - 1, 2 * BLOCK + 2, 7),
]


@pytest.mark.parametrize(("offset", "nbytes", "shift"), CASES)
def test_round_trip_lands_at_the_offset(tmp_path: Path, backend: str, offset: int,
                                        nbytes: int, shift: int) -> None:
    path = tmp_path / "tier.bin"
    size = offset + nbytes + 3 * ALIGN_BYTES + 5
    with AioEngine(backend=backend, block_bytes=BLOCK, queue_depth=4, thread_count=2) as e:
        assert e.backend == backend
        file = e.open(path, size)
        assert os.path.getsize(path) == -(-size // ALIGN_BYTES) * ALIGN_BYTES  # rounded up
        data = aligned_empty(nbytes + shift, pin=False)[shift:]
        data.copy_(_random_bytes(nbytes, seed=nbytes))
        e.write(file, offset, data).wait()
        back = aligned_empty(nbytes + 3, pin=False)[3:]  # another misalignment
        back.fill_(0xAB)
        e.read(file, offset, back).wait()
        assert torch.equal(back, data)
    lead = 1 if offset else 0
    on_disk = _on_disk(path, offset - lead, lead + nbytes + 1)
    assert on_disk[lead:lead + nbytes] == bytes(data.numpy())
    # the neighbours stay zero: nothing was written before or after the range
    assert on_disk[:lead] == b"\0" * lead and on_disk[lead + nbytes:] == b"\0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int16])
def test_any_dtype_moves_its_bytes(tmp_path: Path, backend: str, dtype: torch.dtype) -> None:
    src = torch.randn(1001, 3).to(dtype)
    with AioEngine(backend=backend, block_bytes=BLOCK) as e:
        file = e.open(tmp_path / "t.bin", src.numel() * src.element_size() + 100)
        e.write(file, 100, src).wait()
        dst = torch.empty_like(src)
        e.read(file, 100, dst).wait()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("thread_count", [1, 3])
def test_many_requests_from_several_threads(tmp_path: Path, backend: str,
                                            thread_count: int) -> None:
    rng = random.Random(thread_count)
    # 160 regions of random sizes, each at a random gap from the last (odd offsets)
    regions, at = [], 0
    for _ in range(160):
        at += rng.randrange(0, 3 * ALIGN_BYTES)
        n = rng.choice([1, 100, ALIGN_BYTES, 3 * ALIGN_BYTES + 5, BLOCK + 11, 3 * BLOCK])
        regions.append((at, n))
        at += n
    datas = [_random_bytes(n, seed=i) for i, (_, n) in enumerate(regions)]
    errors: list[BaseException] = []
    with AioEngine(backend=backend, block_bytes=BLOCK, queue_depth=8,
                   thread_count=thread_count) as e:
        file = e.open(tmp_path / "many.bin", at + 1)

        def writer(k: int) -> None:  # four threads submit at once, then wait for theirs
            try:
                mine = [e.write(file, regions[i][0], datas[i]) for i in range(k, 160, 4)]
                for request in mine:
                    request.wait()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        backs = [torch.empty_like(d) for d in datas]
        reads = [e.read(file, off, b) for (off, _), b in zip(regions, backs)]
        for request in reads:
            request.wait()
        counters = e.counters()
    for (off, n), d, b in zip(regions, datas, backs):
        assert torch.equal(b, d), f"region at {off} of {n} bytes"
        assert _on_disk(tmp_path / "many.bin", off, n) == bytes(d.numpy())
    total = sum(n for _, n in regions)
    assert counters.bytes_written == total and counters.bytes_read == total
    assert counters.writes == counters.reads == 160 and counters.busy_s > 0


def _ring(backend: str, **sizes: int):  # type: ignore[no-untyped-def]
    if backend == "threads":
        return ThreadRing(**sizes)
    return c_engine().CRing(backend, **sizes)


def test_a_small_request_finishes_before_a_large_one_submitted_first(
        tmp_path: Path, backend: str) -> None:
    """Round robin over requests (cext/so_aio.c ``fill``) with one block in flight: the
    large write's first block, then the small read's only block, so the ring reports the
    small one first whatever the timing (first in, first out would finish the 64 blocks of
    the large one first)."""
    path = tmp_path / "order.bin"
    path.write_bytes(b"\1" * (65 * BLOCK))
    fd = os.open(path, os.O_RDWR)
    big, small = aligned_empty(64 * BLOCK, pin=False), aligned_empty(ALIGN_BYTES, pin=False)
    ring = _ring(backend, queue_depth=1, max_requests=8, block_bytes=BLOCK,
                 align_bytes=ALIGN_BYTES)
    try:
        ring.submit(RingOp(-1, fd, True, big.data_ptr(), 0, big.numel(), tag=1))
        ring.submit(RingOp(-1, fd, False, small.data_ptr(), 64 * BLOCK, ALIGN_BYTES, tag=2))
        order: list[int] = []
        while len(order) < 2:
            order += [c.tag for c in ring.run(-1)]
        assert order == [2, 1]
        assert small.eq(1).all()
    finally:
        ring.close()
        os.close(fd)


def test_block_lengths_cut_the_head_the_blocks_and_the_tail() -> None:
    a, b = ALIGN_BYTES, 4 * ALIGN_BYTES
    assert block_length(a - 3, 100 * a, b, a) == 3  # the head, up to the first aligned offset
    assert block_length(a, 100 * a, b, a) == b  # whole blocks
    assert block_length(a, b - 1, b, a) == 3 * a  # an aligned body, then ...
    assert block_length(4 * a, a - 1, b, a) == a - 1  # ... the tail alone
    assert block_length(0, 5, b, a) == 5


def test_a_request_is_split_among_the_submitters_in_whole_blocks() -> None:
    assert split_request(0, BLOCK, 3) == []
    assert split_request(BLOCK - 1, BLOCK, 3) == [(0, BLOCK - 1)]  # small: one submitter
    parts = split_request(10 * BLOCK + 5, BLOCK, 3)
    assert parts == [(0, 4 * BLOCK), (4 * BLOCK, 4 * BLOCK), (8 * BLOCK, 2 * BLOCK + 5)]


def test_aligned_empty_is_aligned_and_sized() -> None:
    for n in (0, 1, 4097, 1 << 20):
        t = aligned_empty(n, pin=False)
        assert t.dtype == torch.uint8 and t.numel() == n and t.device.type == "cpu"
        assert t.data_ptr() % ALIGN_BYTES == 0
    assert aligned_empty(10, pin=False, alignment=1 << 16).data_ptr() % (1 << 16) == 0
    pinned = aligned_empty(5000, pin=True)  # pinned only where CUDA can use it
    assert pinned.is_pinned() == torch.cuda.is_available()
    assert pinned.data_ptr() % ALIGN_BYTES == 0 and pinned.numel() == 5000
    with pytest.raises(ValueError, match="alignment=3 must be a power of two"):
        aligned_empty(10, pin=False, alignment=3)
    with pytest.raises(ValueError, match="nbytes=-1"):
        aligned_empty(-1, pin=False)


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    for kwargs, words in [({"queue_depth": 0}, "queue_depth=0"),
                          ({"block_bytes": 5000}, "block_bytes=5000 must be a multiple"),
                          ({"thread_count": True}, "thread_count=True"),
                          ({"direct": "yes"}, "direct='yes'"),
                          ({"backend": "spdk"}, "backend='spdk'")]:
        with pytest.raises(ValueError, match=words):
            AioEngine(**kwargs)  # type: ignore[arg-type]
    with AioEngine(backend="threads") as e:
        file = e.open(tmp_path / "a.bin", 100)
        with pytest.raises(ValueError, match="within the file's 100 bytes"):
            e.write(file, 90, torch.zeros(11, dtype=torch.uint8))
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            e.write(file, 0, torch.zeros(4, 4)[:, 0])
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            e.read(file, 0, bytearray(4))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="size_bytes=0"):
            e.open(tmp_path / "b.bin", 0)
        e.read(file, 0, torch.empty(0)).wait()  # nothing to move: done at once
    with pytest.raises(RuntimeError, match="closed"):
        e.open(tmp_path / "c.bin", 10)


def test_close_waits_for_requests_in_flight(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "close.bin"
    datas = [_random_bytes(BLOCK * 3 + i, seed=i) for i in range(24)]
    e = AioEngine(backend=backend, block_bytes=BLOCK, queue_depth=2)
    file = e.open(path, 24 * 4 * BLOCK)
    requests = [e.write(file, i * 4 * BLOCK, d) for i, d in enumerate(datas)]
    e.close()  # right away: most are still queued or in flight
    assert all(r.done() for r in requests)
    for i, d in enumerate(datas):
        assert _on_disk(path, i * 4 * BLOCK, d.numel()) == bytes(d.numpy())
    e.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        e.write(file, 0, datas[0])


def test_measure_storage_reports_this_engine(tmp_path: Path) -> None:
    m = measure_storage(tmp_path, size_bytes=4 << 20, block_bytes=BLOCK, queue_depth=4)
    assert m.read_gbps > 0 and m.write_gbps > 0
    assert (m.queue_depth, m.block_bytes) == (4, BLOCK)
    assert m.backend == BACKENDS_HERE[0] and isinstance(m.direct, bool)
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_every_backend_is_known() -> None:
    assert set(BACKENDS_HERE) <= set(BACKENDS) and BACKENDS_HERE[-1] == "threads"
