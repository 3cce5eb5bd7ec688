"""Two `train` runs with the same new --out, in real processes (commands/run_lock.py).

They used to both find the folder empty, both train and both exit 0, leaving one
`result.json` and each other's checkpoints mixed. Now the first to lock the folder runs and
the other is refused at once (exit code 2), naming the folder and the running one's pid.
Every process is started in its own session and killed as a group if it outlives the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from superoffload.commands.run_lock import LOCK_NAME

ARGS = ["--model", "tiny", "--batch", "2", "--seq", "32", "--eval-batches", "0",
        "--device", "cpu", "--quiet", "--no-report"]
TIMEOUT_S = 180


def _start(cwd: Path, out: Path, steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "superoffload", "train", *ARGS, "--steps",
                             str(steps), "--out", str(out)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)


def _refusal(stderr: str, out: Path, pid: int) -> None:
    lines = stderr.strip().splitlines()
    assert lines[-1] == (f"python -m superoffload train: error: --out {out}: another "
                         f"`superoffload train` run (pid {pid}) is using the run folder {out} "
                         "now; wait for it to end, or choose another --out"), stderr[-2000:]


def test_a_second_run_into_a_running_runs_folder_is_refused_naming_its_pid(tmp_path: Path
                                                                           ) -> None:
    out = tmp_path / "run"
    first = _start(tmp_path, out, 100_000)  # trains until killed
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / LOCK_NAME).exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run never locked its folder"
            time.sleep(0.05)
        second = _start(tmp_path, out, 5)
        try:
            _, err = second.communicate(timeout=TIMEOUT_S)
        finally:
            _kill(second)
        assert second.returncode == 2
        _refusal(err, out, first.pid)
        assert first.poll() is None  # the running one goes on, untouched
    finally:
        _kill(first)
    # the holder is gone (killed): its lock went with it. With what the killed run wrote
    # removed (its planner calibration), the folder takes a new run, lock file and all
    for leftover in out.iterdir():
        if leftover.name != LOCK_NAME:
            leftover.unlink()
    third = _start(tmp_path, out, 2)
    try:
        _, err = third.communicate(timeout=TIMEOUT_S)
    finally:
        _kill(third)
    assert third.returncode == 0, err[-3000:]
    assert (out / "result.json").exists()


def test_two_runs_started_at_once_with_one_new_out_do_not_both_succeed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    procs = [_start(tmp_path, out, 40) for _ in range(2)]
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            _kill(proc)
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [(code, err[-1500:]) for code, err in results]
    winner = next(p for p, (code, _) in zip(procs, results) if code == 0)
    refused = next(err for code, err in results if code == 2)
    if "not empty" in refused:  # the winner had already finished: refused as a used folder
        assert f"--out {out}: the folder exists and is not empty" in refused
    else:
        _refusal(refused, out, winner.pid)
