"""Opening the storage tier when the engine builds its buckets: the placement rule, the file
(allocated in full, so a full disk fails here and never mid-run), the pinned pool, and the
initial state written through it (docs/storage.md, "Files").

The file of one engine (rank) is ``superoffload-state-<pid>-<random>-rank<r>.bin`` in
``OffloadConfig.storage_path``; the engine holds an exclusive ``flock`` on it while it runs.
A file of that name nobody holds, whose process is gone, is left over from a run that died
(``kill -9``, a crash): it is scratch (the state a run resumes from is its checkpoint,
docs/storage.md, "Durability") and is deleted here, saying so; a file a live run holds is left
alone, and so is one whose process still lives (it may be between creating its file and
locking it: ranks sharing a folder start together).
"""

from __future__ import annotations

import fcntl
import os
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.plan.buckets import Bucket, BucketPlan
from superoffload.plan.storage import (
    ALIGN,
    ElementBytes,
    Homes,
    Place,
    TierError,
    TierPlan,
    plan_tier,
)
from superoffload.runtime.casting import CastPolicy
from superoffload.runtime.engine_state import BucketBuffers, ParamState
from superoffload.runtime.lanes import Lane
from superoffload.runtime.tier import StateTier
from superoffload.runtime.tier_access import fill
from superoffload.telemetry.recorder import Recorder

PREFIX = "superoffload-state-"


class StorageNotice(UserWarning):
    """What the storage tier did on its own (stale files removed, buffered I/O)."""


@dataclass(frozen=True, slots=True)
class Storage:
    """What building reads of the configuration for the tier (``OffloadConfig.storage_*``)."""

    path: str | None
    budget_bytes: int | None
    buffer_count: int
    block_bytes: int
    queue_depth: int
    threads: int
    direct: str
    watchdog_s: float
    weight_homes: Place = "host"
    prefetch_depth: int = 1

    @classmethod
    def of(cls, config: OffloadConfig) -> Storage:
        return cls(config.storage_path, config.host_memory_budget_bytes,
                   config.storage_buffer_count, config.storage_block_bytes,
                   config.storage_queue_depth, config.storage_threads, config.storage_direct,
                   config.watchdog_s, config.weight_homes, config.prefetch_depth)


def element_bytes(cast: CastPolicy, moments: torch.dtype, *, snapshot: bool,
                  flow: bool) -> ElementBytes:
    """Bytes per element of an offloaded bucket as the buffers are allocated
    (engine_state.py)."""
    # a host low-precision copy is part of the state only when the cast runs on the host
    lp = 0
    if cast.low_precision and cast.param_on_host:
        lp = cast.model_dtype.itemsize
    return ElementBytes(moment=moments.itemsize, grad=cast.grad_host_dtype.itemsize, lp=lp,
                        snapshot=snapshot, home=lp if flow else 0)


def homes_of(storage: Storage, cast: CastPolicy, flow: bool) -> Homes | None:
    """Weight-flow's homes for the rule (``OffloadConfig.weight_homes``): a fetch copies the
    model dtype (the host copy, or an fp32 model's master) through ``prefetch_depth + 1``
    staging buffers; None without weight-flow."""
    if not flow:
        return None
    return Homes(storage.weight_homes, cast.model_dtype.itemsize, storage.prefetch_depth + 1)


def place(plan: BucketPlan, numel: Mapping[int, int], storage: Storage,
          element: ElementBytes, homes: Homes | None = None) -> TierPlan:
    """Which offloaded buckets live in the file (plan/storage.py's rule), with this rank's
    elements per bucket (``numel``: FSDP2 ranks hold shards), and where weight-flow's homes
    live (``homes``); the rule's errors as the configuration's."""
    local = [Bucket(b.id, b.param_indices, numel[b.id], False) for b in plan.host_buckets]
    try:
        return plan_tier(local, element, storage=storage.path is not None,
                         budget_bytes=storage.budget_bytes, buffer_count=storage.buffer_count,
                         homes=homes)
    except TierError as exc:
        raise ConfigError(str(exc)) from None


def open_tier(tier: TierPlan, buffers: Sequence[BucketBuffers],
              states_of: Callable[[int], list[ParamState]], *, storage: Storage,
              cast: CastPolicy,
              moments: torch.dtype, flow: bool, alloc_host: object,
              pinned: tuple[Callable[[int], torch.Tensor], Callable[[torch.Tensor], None]],
              lanes: tuple[Lane, Lane],
              landed: object, recorder: Recorder, rank: int,
              track: object, raise_failed: object) -> StateTier:
    """The file allocated in full, the pool, the states written (bucket by bucket: memory
    bounded by the pool). ``buffers``: every bucket's, the tier ones unallocated;
    ``states_of(b)``: bucket ``b``'s placement-free states, in its order."""
    from superoffload.storage.aio import AioEngine

    assert storage.path is not None
    folder = Path(storage.path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"OffloadConfig.storage_path={storage.path!r}: cannot create the "
                          f"folder ({exc.strerror}); name a writable folder on a local "
                          "disk") from None
    remove_stale(folder)
    path = folder / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}.bin"
    io = AioEngine(queue_depth=storage.queue_depth, block_bytes=storage.block_bytes,
                   thread_count=storage.threads, direct=storage.direct)
    try:
        file = io.open(str(path), tier.file_bytes, create=True)
    except BaseException:
        io.close()
        raise
    lock = os.open(path, os.O_RDONLY)
    # ours: remove_stale leaves it alone
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    alloc, free = pinned
    # given back when the tier closes (pinned on CUDA)
    raw: list[torch.Tensor] = []
    pool = aligned_pool(tier.slots, tier.slot.nbytes, alloc, raw)
    # weight-flow's home reads
    stage = aligned_pool(tier.stage[0], tier.stage[1], alloc, raw)
    lp_dtype = None
    if cast.low_precision and cast.param_on_host:
        lp_dtype = cast.model_dtype
    store = StateTier(tier, buffers, io=io, file=file, slots=pool, read_lane=lanes[0],
                      write_lane=lanes[1], recorder=recorder,
                      landed=landed,  # type: ignore[arg-type]
                      watchdog_s=storage.watchdog_s, track=track,  # type: ignore[arg-type]
                      raise_failed=raise_failed,  # type: ignore[arg-type]
                      moment_dtype=moments,
                      grad_dtype=cast.grad_host_dtype, lp_dtype=lp_dtype, flow=flow,
                      stage=stage, alloc_host=alloc_host)  # type: ignore[arg-type]
    store.path, store.lock_fd = str(path), lock  # close() deletes the file, drops the lock
    store.pinned, store.free_pinned = raw, free  # and gives the pool back
    for b in tier.tier:
        fill(store, b, states_of(b))
    store.wait_idle()
    return store


def remove_stale(folder: Path) -> list[str]:
    """Delete the tier files in ``folder`` that no live engine holds (module docstring)."""
    removed = []
    for path in sorted(folder.glob(f"{PREFIX}*.bin")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # a live run holds it
            continue
        finally:
            os.close(fd)
        # unlocked but its process lives: a peer rank between creating its file and locking
        # it (open_tier creates, allocates, then locks), never a dead run's
        if owner_alive(path):
            continue
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed.append(f"{path.name} ({size:,} bytes)")
    if removed:
        warnings.warn(f"storage tier: removed {len(removed)} file(s) in {folder} left by runs "
                      f"that ended without closing their engine: {', '.join(removed)}",
                      StorageNotice, stacklevel=3)
    return removed


def owner_alive(path: Path) -> bool:
    """Whether the process named in a tier file's name (``PREFIX<pid>-...``) still runs on
    this host (a zombie counts as gone: it holds no file); False for a name without one."""
    pid_text = path.name[len(PREFIX):].split("-", 1)[0]
    if not pid_text.isdigit():
        return False
    try:
        state = Path(f"/proc/{int(pid_text)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def aligned_pool(count: int, nbytes: int, alloc: Callable[[int], torch.Tensor],
                 raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """``count`` buffers of ``nbytes``, each starting on an ``ALIGN`` boundary, cut from one
    allocation of ``alloc`` (uint8; DeviceOps.alloc_pinned pins it on CUDA), appended to
    ``raw`` to be given back."""
    if count == 0 or nbytes == 0:
        return []
    block = alloc(count * nbytes + ALIGN)
    raw.append(block)
    skip = (-block.data_ptr()) % ALIGN
    return [block[skip + k * nbytes:skip + (k + 1) * nbytes] for k in range(count)]
