"""A data-parallel `train` whose rank is killed (SIGKILL) resumes from its last periodic
checkpoint and ends bit-identical to an uninterrupted run (2 gloo processes under torchrun).

`kill -9` of one worker: the other rank's next collective (one of FSDP2's, or the engine's)
fails at once with `DistributedError` naming the dead rank, torchrun stops the job, and no
process is left; the work since the last checkpoint (DCP, written every 3 steps) is lost and
nothing else: `--resume` of the run folder on a new 2-process launch ends with the same
masters, moments, step counts, counters, data positions and losses as the uninterrupted run
(tests/test_cli_resume.py's helpers; the SIGTERM path is tested there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _dist_support import alive
from test_cli_resume import DP, TIMEOUT_S, _command, _env, _kill, _run

from superoffload.commands.checkpointing import LATEST


def _worker_pids(out: Path) -> list[int]:
    """Training processes of the run writing to ``out`` (their command line names it)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(out) in text and "torch.distributed.run" not in text:
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.slow
def test_a_killed_rank_resumes_bit_identically(tmp_path: Path) -> None:
    from superoffload.distributed.fsdp import consolidate

    ref = _run(tmp_path, *DP, "--out", str(tmp_path / "ref"), torchrun=True)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    out = tmp_path / "run"
    proc = subprocess.Popen(_command(*DP, "--checkpoint-every", "3", "--out", str(out),
                                     torchrun=True), cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "checkpoints" / LATEST).exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no periodic checkpoint appeared"
            time.sleep(0.02)
        victims = _worker_pids(out)
        assert len(victims) == 2, victims
        os.kill(max(victims), signal.SIGKILL)  # one rank, as the OOM killer would
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        _kill(proc)
    assert proc.returncode != 0
    # the survivor names the dead rank: in its collective's DistributedError, or in its stop
    # line when torchrun's SIGTERM (it ends the job once a rank dies) comes first
    assert "have exited" in stderr, stderr[-3000:]
    assert "DistributedError" in stderr or "SIGTERM received" in stderr, stderr[-3000:]
    assert not any(alive(pid) for pid in victims)  # no worker outlives the job
    resumed = _run(tmp_path, "--resume", str(out), "--quiet", "--json", "--save-checkpoint",
                   "--no-report", torchrun=True)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    a, b = consolidate(str(tmp_path / "ref" / "checkpoint")), consolidate(str(out / "checkpoint"))
    assert a.states.keys() == b.states.keys()
    for name, st in a.states.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(st, key), getattr(b.states[name], key)), (name, key)
        assert st.step == b.states[name].step
    assert a.manifest["iteration"] == b.manifest["iteration"] == 40
    assert a.manifest["stats"] == b.manifest["stats"]
    assert a.extra["progress"] == b.extra["progress"]
    ra = json.loads((tmp_path / "ref" / "result.json").read_text())
    rb = json.loads((out / "result.json").read_text())
    assert (ra["final_loss"], ra["val_loss"]) == (rb["final_loss"], rb["val_loss"])
