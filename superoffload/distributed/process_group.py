"""Start torch.distributed from torchrun's environment, with bounded timeouts and clear errors.

`torchrun --nproc-per-node N <your_script>.py` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT for each rank (PyTorch docs, "torchrun (Elastic Launch)"); `init_distributed()`
reads them, picks NCCL when CUDA is present and gloo otherwise, binds the rank to
cuda:LOCAL_RANK, and creates the dp x sp groups of `groups.py`. Run without torchrun (none of
the variables set) it starts a one-rank group, so the same script works on a laptop.

Hangs: every collective of the process group times out after `timeout_s` (gloo raises in the
calling thread; NCCL's watchdog tears the process down, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, the
default). A rank that *dies* is usually noticed sooner: gloo sees the closed TCP connection at
the next collective, and torchrun's agent stops the remaining workers of a failed group.
`collective_guard()` turns the dist backend's error into a `DistributedError` that names this
rank, the collective, the timeout and the peer on this host that died.

    info = init_distributed(sp=2)            # under torchrun
    groups = get_groups()                     # .sp_group for Ulysses, .world_group for grads
    ...
    shutdown()
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from superoffload.distributed.groups import ParallelGroups, create_groups, plan_parallel_layout
from superoffload.runtime.errors import EngineError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Variables torchrun sets for every worker; init_distributed needs all or none of them."""

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout: long enough for a slow first step (model build, kernel compilation on
one rank), short enough that a stuck job fails within minutes instead of torch's 30 min."""
MIN_TIMEOUT_S = 1.0
"""The shortest collective timeout accepted (``init_distributed``, ``--dist-timeout-s``): below
it a healthy job's rendezvous can time out, and a near-zero ``timedelta`` fails in torch's C++."""

PEER_EXIT_WAIT_S = 5.0
"""How long a failed collective waits for a local peer's process to end before naming the cause
(``exited_soon`` wakes at the exit). A killed torch process takes seconds to be torn down (over 2
s seen on 2 busy cores); only a failure with no local peer exiting waits it out, once."""


def timeout_ok(timeout_s: float) -> bool:
    """The collective timeout rule of ``init_distributed`` and ``--dist-timeout-s``."""
    return math.isfinite(timeout_s) and timeout_s >= MIN_TIMEOUT_S


class DistributedError(EngineError):
    """A collective failed: a peer rank died, stalled past the timeout, or the shapes differ.
    An ``EngineError`` (runtime/errors.py), so both engines raise one family."""


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank in [0, world_size)."""
    world_size: int
    local_rank: int
    """Rank on this node (torchrun's LOCAL_RANK): selects the GPU."""
    backend: str
    """"gloo" or "nccl"."""
    device: str
    """"cpu" or "cuda:LOCAL_RANK": where this rank's model lives."""
    dp: int
    """Data-parallel degree (size of the dp group)."""
    sp: int
    """Sequence-parallel degree (size of the sp group)."""
    dp_rank: int
    sp_rank: int
    timeout_s: float
    replicate: int = 1
    """HSDP replicas among the dp ranks (``--dp-replicate``); 1: plain FSDP sharding."""


@dataclass(frozen=True, slots=True)
class RankProcess:
    """Where a rank's process runs: lets a survivor say which local peer has exited."""

    host: str
    pid: int


@dataclass(slots=True)
class _State:
    info: DistInfo
    groups: ParallelGroups
    owns_group: bool
    processes: list[RankProcess]
    """Indexed by global rank; exchanged once at init."""


_STATE: _State | None = None  # torch.distributed's default group is process-global too


def _env_int(env: dict[str, str], name: str) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer: "
                         "launch with torchrun, which sets it") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={value} is negative: launch with torchrun")
    return value


def resolve_backend(backend: str) -> str:
    """"auto" -> "nccl" with CUDA, else "gloo". Explicit "nccl" without CUDA is an error."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError('backend="nccl" needs CUDA, and no GPU is visible: use backend="gloo" '
                         'or "auto" on a CPU machine')
    if backend not in ("gloo", "nccl"):
        raise ValueError(f'backend={backend!r} is not supported: use "auto", "gloo" or "nccl"')
    return backend


def init_distributed(*, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                     dp: int | None = None, sp: int = 1, replicate: int = 1,
                     env: dict[str, str] | None = None) -> DistInfo:
    """Initialise torch.distributed from torchrun's environment and create the dp x sp mesh.

    backend: "auto" (nccl on CUDA, gloo on CPU), "gloo" or "nccl".
    timeout_s: every collective fails after this many seconds instead of hanging.
    dp, sp: parallel degrees with dp * sp == WORLD_SIZE (dp=None infers it).
    replicate: HSDP replicas among the dp ranks (mesh.py; 1: shard over all of them).
    env: the environment to read (default os.environ; tests pass a dict).
    Calling it again in the same process with the same arguments returns the same DistInfo.
    """
    global _STATE
    env = dict(os.environ) if env is None else env
    # a bool is an int to isinstance; timeout_ok refuses nan, inf and near-zero values
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) \
            or not timeout_ok(timeout_s):
        raise ValueError(f"timeout_s={timeout_s!r} is invalid: use a finite number of seconds "
                         f">= {MIN_TIMEOUT_S:g}")
    if _STATE is not None:
        if ((dp not in (None, _STATE.info.dp)) or sp != _STATE.info.sp
                or replicate != _STATE.info.replicate):
            raise ValueError(
                f"init_distributed: already initialised with dp={_STATE.info.dp}, "
                f"sp={_STATE.info.sp}, replicate={_STATE.info.replicate}; call shutdown() "
                f"before re-initialising with dp={dp}, sp={sp}, replicate={replicate}")
        return _STATE.info
    present = [name for name in TORCHRUN_ENV if name in env]
    if present and len(present) != len(TORCHRUN_ENV):
        missing = [name for name in TORCHRUN_ENV if name not in env]
        raise ValueError(f"torchrun environment incomplete: {', '.join(missing)} not set (have "
                         f"{', '.join(present)}): launch with torchrun, or set all of "
                         f"{', '.join(TORCHRUN_ENV)}")
    backend = resolve_backend(backend)
    if present:
        rank, world_size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        local_rank = _env_int(env, "LOCAL_RANK")
        if not rank < world_size:
            raise ValueError(
                f"RANK={rank} is not below WORLD_SIZE={world_size}: check the launcher")
    else:
        rank, world_size, local_rank = 0, 1, 0
    # validate before any networking
    layout = plan_parallel_layout(world_size, dp=dp, sp=sp, replicate=replicate)

    device = "cpu"
    if backend == "nccl":
        n_gpu = torch.cuda.device_count()
        if local_rank >= n_gpu:
            raise ValueError(f"LOCAL_RANK={local_rank} but only {n_gpu} GPU(s) are visible: "
                             f"launch at most {n_gpu} processes per node (--nproc-per-node)")
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"

    # a group the caller made (Accelerate, Lightning) is used, and never destroyed by us
    owns_group = not dist.is_initialized()
    if owns_group:
        timeout = timedelta(seconds=float(timeout_s))
        if present:
            # env:// rendezvous: MASTER_ADDR/MASTER_PORT name rank 0's TCPStore
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=world_size, timeout=timeout,
                                    device_id=torch.device(device) if backend == "nccl" else None)
        else:
            # one rank and no launcher: an in-memory store, no port to pick
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    try:
        groups = create_groups(layout, timeout_s=float(timeout_s),
                               device_type="cuda" if backend == "nccl" else "cpu")
        processes = _exchange_processes(world_size)
    except Exception:
        # a failed init leaves no half-made group, so the caller may try again
        if owns_group:
            dist.destroy_process_group()
        raise
    dp_rank, sp_rank = layout.coords(rank)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                    device=device, dp=layout.dp, sp=layout.sp, dp_rank=dp_rank,
                    sp_rank=sp_rank, timeout_s=float(timeout_s), replicate=layout.replicate)
    _STATE = _State(info=info, groups=groups, owns_group=owns_group, processes=processes)
    return info


def _exchange_processes(world_size: int) -> list[RankProcess]:
    """(host, pid) of every rank, gathered once so that a failed collective can later name
    the local peers that are gone without talking to anyone."""
    me = RankProcess(host=socket.gethostname(), pid=os.getpid())
    if world_size == 1:
        return [me]
    table: list[object] = [None] * world_size
    with collective_guard("all_gather_object (init_distributed)"):
        dist.all_gather_object(table, me)
    return [p for p in table if isinstance(p, RankProcess)]


def _proc_state(pid: int) -> str | None:
    """The one-letter state of `pid` in /proc ("R", "S", "T" stopped, "Z" zombie, ...), or
    None without procfs; "X" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ...": comm may hold spaces, so split after the last ')'
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "X"
    except OSError:
        return None


def _process_gone(pid: int) -> bool:
    """True when `pid` has exited (including a zombie its parent has not reaped yet)."""
    state = _proc_state(pid)
    if state is not None:
        return state in ("Z", "X")
    try:  # no procfs (macOS): fall back to signal 0
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _local_peers(ranks: list[int], test: Callable[[int], bool]) -> list[int]:
    """Ranks among `ranks` on this host, not this one, whose process pid passes `test`
    (remote ranks are never listed: we cannot see them)."""
    # no table, or one from another layout: naming a wrong peer is worse than naming none
    if _STATE is None or len(_STATE.processes) != _STATE.info.world_size:
        return []
    host, procs = socket.gethostname(), _STATE.processes
    return [r for r in ranks
            if procs[r].host == host and r != _STATE.info.rank and test(procs[r].pid)]


def stopped_peers(ranks: list[int]) -> list[int]:
    """Ranks among `ranks` on this host whose process is stopped (SIGSTOP, a debugger)."""
    return _local_peers(ranks, lambda pid: _proc_state(pid) in ("T", "t"))


def exited_peers(ranks: list[int]) -> list[int]:
    """Ranks among `ranks` on this host whose process has exited."""
    return _local_peers(ranks, _process_gone)


def exited_soon(ranks: list[int], timeout_s: float) -> list[int]:
    """Ranks among `ranks` on this host whose process has exited, or exits within
    `timeout_s` (a process descriptor per peer wakes the wait at its exit; without them,
    only those gone already)."""
    gone = exited_peers(ranks)
    # pidfd_open is Linux-only (3.9+ Python, 5.3+ kernel): elsewhere, only those gone already
    if gone or _STATE is None or not hasattr(os, "pidfd_open"):
        return gone
    fds: dict[int, int] = {}
    try:
        for r in _local_peers(ranks, lambda pid: True):
            with contextlib.suppress(OSError):  # gone already, or not ours to watch
                fds[os.pidfd_open(_STATE.processes[r].pid)] = r
        if fds:
            select.select(list(fds), [], [], timeout_s)  # readable once a process has ended
    finally:
        for fd in fds:
            os.close(fd)
    return exited_peers(ranks)


def stall_cause(ranks: list[int]) -> str:
    """Which of ``ranks`` on this host is stopped or gone, for a watchdog's message."""
    stopped, gone = stopped_peers(ranks), exited_peers(ranks)
    if stopped:
        return f"rank(s) {stopped} on this host are stopped"
    if gone:
        return f"rank(s) {gone} on this host have exited"
    return "no local peer is stopped or gone: look at the other hosts' ranks"


def _require_state(caller: str) -> _State:
    if _STATE is None:
        raise RuntimeError(f"{caller}: call superoffload.distributed.init_distributed() first")
    return _STATE


def dist_info() -> DistInfo:
    """This process's rank, world size, local rank, device and dp/sp degrees."""
    return _require_state("dist_info").info


def get_groups() -> ParallelGroups:
    """The dp, sp and world process groups created by init_distributed()."""
    return _require_state("get_groups").groups


def shutdown() -> None:
    """Destroy the process groups init_distributed() created (no-op when not initialised)."""
    global _STATE
    state, _STATE = _STATE, None
    if state is not None and state.owns_group and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collective_guard(collective: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Re-raise a failed collective as DistributedError naming this rank, the peers and the
    timeout, so the log of a surviving rank says what happened instead of a bare gloo/NCCL
    message."""
    try:
        yield
    except RuntimeError as exc:
        # DistBackendError, gloo's IOError-as-RuntimeError, timeouts; an inner guard's goes on
        if isinstance(exc, DistributedError) or not dist.is_initialized():
            raise
        rank, world = dist.get_rank(), dist.get_world_size()
        peers = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        timeout = f"{_STATE.info.timeout_s:g} s" if _STATE is not None else "the group's timeout"
        stopped = stopped_peers(peers)
        # a stall: none exits; else a SIGKILLed rank's sockets close before it shows as exited
        if stopped:
            gone = exited_peers(peers)
        else:
            gone = exited_soon(peers, PEER_EXIT_WAIT_S)
        cause = f"a peer rank died, or stalled past {timeout}, or passed a different shape"
        if gone:
            cause = f"rank(s) {gone} on this host have exited"
        elif stopped:
            cause = (f"rank(s) {stopped} on this host are stopped (SIGSTOP or a debugger) and "
                     f"did not join within {timeout}")
        raise DistributedError(
            f"rank {rank} of {world}: collective {collective} over ranks {peers} failed: "
            f"{cause}. Look at the other ranks' logs for the first error. Backend said: {exc}",
        ) from exc


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Add --dp, --sp, --dist-backend and --dist-timeout-s to a command's parser."""
    group = parser.add_argument_group("parallelism (run under torchrun)")
    group.add_argument("--dp", type=int, default=None,
                       help="data-parallel degree; default WORLD_SIZE / sp")
    group.add_argument("--sp", type=int, default=1,
                       help="sequence-parallel (Ulysses) degree; must divide the heads and the "
                       "sequence length")
    group.add_argument("--dp-replicate", type=int, default=1,
                       help="HSDP: split the dp ranks into this many replicas, each sharding "
                       "the model over dp / dp-replicate ranks (default 1: shard over all)")
    group.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto",
                       help="auto: nccl with CUDA, gloo on the CPU")
    group.add_argument("--dist-timeout-s", type=timeout_arg, default=DEFAULT_TIMEOUT_S,
                       help="collective timeout in seconds: a dead or stuck rank fails the job "
                       f"after at most this long (at least {MIN_TIMEOUT_S:g}; default "
                       f"{DEFAULT_TIMEOUT_S:g})")


def timeout_arg(text: str) -> float:
    """``--dist-timeout-s``: checked where argparse parses it, so a single process refuses it
    too and torchrun's ranks never reach torch with it (argparse prints the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not timeout_ok(value):
        raise argparse.ArgumentTypeError(
            f"{text} is too short or not finite: use a finite number of seconds >= "
            f"{MIN_TIMEOUT_S:g} (the default is {DEFAULT_TIMEOUT_S:g})")
    return value


def init_from_args(args: argparse.Namespace) -> DistInfo:
    """init_distributed() with the options add_parallel_args() added."""
    return init_distributed(backend=args.dist_backend, timeout_s=args.dist_timeout_s,
                            dp=args.dp, sp=args.sp, replicate=getattr(args, "dp_replicate", 1))
