"""Launch multi-process torch.distributed workers for tests: free ports, bounded waits, no
orphans.

Workers run tests/_dist_worker.py in fresh interpreters with torchrun's environment variables
set by hand (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so a test sees each
rank's exit code and log, and a dying rank is not masked by torchrun's agent stopping the
others. `run_torchrun` covers the real launcher. Every process is started in its own session
and killed (its whole process group) when the test is done with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("_dist_worker.py")


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None
    """None: still running when the test stopped waiting (it was then killed)."""
    log: str
    """stdout and stderr of the rank."""


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # 2 shared cores: one intra-op thread per rank keeps ranks from fighting.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group we created for `proc` (start_new_session), then reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _kill_recorded_pids(out_dir: Path) -> None:
    """Workers write their pid; kill any still alive (torchrun starts them in new sessions)."""
    for pid_file in out_dir.glob("pid_rank*.txt"):
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def run_ranks(scenario: str, world_size: int, out_dir: Path, *, timeout_s: float,
              args: dict | None = None, wait_for: tuple[int, ...] | None = None,
              worker: Path = WORKER) -> list[RankResult]:
    """Run `scenario` on `world_size` ranks; wait at most `timeout_s` for the ranks in
    `wait_for` (default all), then kill every rank still running. `worker`: the script each
    rank runs (default tests/_dist_worker.py; tests/_fsdp_dp_worker.py for data parallel)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):  # retry once if another process grabbed the port meanwhile
        port = free_port()
        procs, logs = [], []
        try:
            for rank in range(world_size):
                log_path = out_dir / f"log_{scenario}_rank{rank}_{attempt}.txt"
                logs.append(log_path)
                env = _worker_env({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
                with open(log_path, "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, str(worker), scenario, str(out_dir),
                         json.dumps(args or {})],
                        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout_s
            for rank in wait_for if wait_for is not None else range(world_size):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[rank].wait(timeout=max(0.0, deadline - time.monotonic()))
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:
                _kill_group(p)
        results = [RankResult(r, codes[r], logs[r].read_text(errors="replace"))
                   for r in range(world_size)]
        if not any("address already in use" in r.log.lower() for r in results):
            return results
    return results


def run_torchrun(scenario: str, nproc: int, out_dir: Path, *, timeout_s: float,
                 args: dict | None = None) -> tuple[int | None, str]:
    """Run `scenario` under `python -m torch.distributed.run --standalone` (torchrun picks a
    free port itself). Returns (exit code or None on timeout, combined log)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"log_torchrun_{scenario}.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", str(WORKER), scenario,
           str(out_dir), json.dumps(args or {})]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=_worker_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the agent stops its workers on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    finally:
        code = proc.poll()
        _kill_group(proc)
        _kill_recorded_pids(out_dir)
    return code, log_path.read_text(errors="replace")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); treat it as dead once its parent reaped it
    return Path(f"/proc/{pid}").exists()
