"""SIGTERM / SIGINT while the main thread is inside one long operation.

`train --seq 100000` started a first step that did not end in 10 minutes, and a SIGTERM sent
meanwhile waited for it without a word: Python runs a signal handler only when the main
thread returns to Python code. `StopSignals` answers from a thread woken by the C-level
handler: the first signal is acknowledged within a second, a second one ends the process at
once (exit code 128 + the signal), and a single signal still stops at the step boundary.

When no step runs (the final evaluation, setting up), there is no boundary to wait for: a
signal stops the process at once, with one line (it used to say "finishing the current
step" and live on through an evaluation of any length).

The long operation here is one `hashlib.pbkdf2_hmac` call (C code that releases the GIL and
runs no Python code, as a torch kernel does), sized in the child to last a few seconds.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

CHILD = r"""
import contextlib, hashlib, signal, sys, time
try:
    from superoffload.commands.signals import StopSignals
except ImportError:  # older trees kept it in checkpointing.py
    from superoffload.commands.checkpointing import StopSignals

def long_call(seconds):
    n = 20000  # calibrate: iterations per second of this machine, now
    t = time.perf_counter(); hashlib.pbkdf2_hmac("sha256", b"k", b"salt", n)
    rate = n / max(time.perf_counter() - t, 1e-6)
    hashlib.pbkdf2_hmac("sha256", b"k", b"salt", int(rate * seconds))

with StopSignals() as stop:
    # a step (signals wait for its boundary), or, with "idle", work outside any step
    steps = contextlib.nullcontext() if sys.argv[2:] == ["idle"] else stop.deferring()
    with steps:
        print("ready", flush=True)
        t0 = time.monotonic()
        long_call(float(sys.argv[1]))
        print(f"long call ended after {time.monotonic() - t0:.1f} s", flush=True)
print(f"signum {stop.signum}", flush=True)
"""


def _start(seconds: float, *mode: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(seconds), *mode],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    assert _read_line(proc.stdout, 60.0) == "ready"
    return proc


def _read_line(stream, timeout_s: float) -> str | None:
    """One line from a pipe within `timeout_s` (None when none came)."""
    deadline, buf = time.monotonic() + timeout_s, b""
    fd = stream.fileno()
    while b"\n" not in buf:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(fd, 1)
        if not chunk:
            return buf.decode() or None
        buf += chunk
    return buf.decode().strip()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_signal_is_answered_within_a_second_and_a_second_one_stops_at_once() -> None:
    proc = _start(8.0)  # ended by the second signal after ~1 s
    try:
        time.sleep(0.3)  # inside the long call now
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        line = _read_line(proc.stderr, 5.0)
        answered_s = time.monotonic() - t0
        assert line is not None and line.startswith("train: SIGTERM received: finishing the "
                                                    "current step"), line
        assert answered_s < 1.0, f"answered after {answered_s:.2f} s"
        assert proc.poll() is None  # the first signal only asks
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=5)
        assert time.monotonic() - t1 < 1.0 and code == 128 + signal.SIGTERM
        assert _read_line(proc.stderr, 1.0) == ("train: SIGTERM again: stopping now, without a "
                                                "checkpoint")
        assert proc.stdout is not None and proc.stdout.read().decode() == ""  # never ended
    finally:
        _stop(proc)


def test_one_signal_still_stops_at_the_step_boundary() -> None:
    proc = _start(2.0)
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert (_read_line(proc.stderr, 5.0) or "").startswith("train: SIGINT received")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0  # the operation ran to its end, then the loop would stop
        lines = out.decode().splitlines()
        assert lines[0].startswith("long call ended") and lines[-1] == f"signum {signal.SIGINT}"
    finally:
        _stop(proc)


def test_a_signal_when_no_step_runs_stops_at_once() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = _start(8.0, "idle")
        try:
            time.sleep(0.3)  # inside the long call, outside any step
            t0 = time.monotonic()
            proc.send_signal(sig)
            code = proc.wait(timeout=5)
            assert time.monotonic() - t0 < 1.0 and code == 128 + sig
            name = signal.Signals(sig).name
            assert _read_line(proc.stderr, 1.0) == (f"train: {name} received while no training "
                                                    "step runs: stopping now (checkpoints "
                                                    "already written are kept)")
            assert proc.stdout is not None and proc.stdout.read().decode() == ""
        finally:
            _stop(proc)


def test_the_stop_line_names_a_local_rank_that_has_exited(monkeypatch) -> None:
    # torchrun SIGTERMs the survivors once one rank dies, often before their collective fails:
    # the stop line is then the only place the dead rank can be named
    from types import SimpleNamespace

    from superoffload.commands import signals

    assert signals.gone_peers_note() == ""  # a single process: no peers
    asked: list[list[int]] = []
    monkeypatch.setattr(signals, "dist_info", lambda: SimpleNamespace(world_size=3))
    monkeypatch.setattr(signals, "exited_peers", lambda ranks: asked.append(ranks) or [])
    assert signals.gone_peers_note() == "" and asked == [[0, 1, 2]]  # every rank asked about
    monkeypatch.setattr(signals, "exited_peers", lambda ranks: [2])
    assert signals.gone_peers_note() == " (rank(s) [2] on this host have exited)"
