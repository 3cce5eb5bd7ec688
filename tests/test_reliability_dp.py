"""Data-parallel faults: a stalled (SIGSTOP), not dead, rank. Every collective must
end within the configured timeout plus a few seconds, with an error that names the rank and
the collective, and close() must not wait long for stuck threads. (The killed path:
tests/test_fsdp_dp.py::test_a_dead_rank_stops_the_others.) Over FSDP2 the first collective to
fail is FSDP2's own all-gather in the survivor's next forward: its collectives run under our
guard (distributed/fsdp/comm.py), so the message is the same."""

from __future__ import annotations

import json
from pathlib import Path

from _dist_support import run_ranks

WORKER = Path(__file__).with_name("_fsdp_dp_worker.py")
TIMEOUT_S = 5.0


def test_a_stalled_rank_fails_the_survivor_within_the_timeout(tmp_path: Path) -> None:
    results = run_ranks("stall", 2, tmp_path, timeout_s=90, wait_for=(0,), worker=WORKER,
                        args={"timeout_s": TIMEOUT_S})
    assert results[0].returncode == 0, results[0].log[-4000:]
    record = json.loads((tmp_path / "stall_rank0.json").read_text())
    assert record["type"] == "DistributedError" and record["engine_error"], record
    assert "rank(s) [1]" in record["error"] and "stopped" in record["error"], record["error"]
    assert "collective" in record["error"] and "rank 0 of 2" in record["error"]
    # the collective's own timeout ended it (before the fix: still blocked after 500 s)
    assert record["seconds"] < TIMEOUT_S + 10, record
    assert record["close_seconds"] < 8, record


def test_a_checkpoint_write_failing_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    results = run_ranks("ckptfail", 2, tmp_path, timeout_s=90, worker=WORKER,
                        args={"timeout_s": 60})
    for r in results:
        assert r.returncode == 0, r.log[-4000:]
    rank0 = json.loads((tmp_path / "ckptfail_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "ckptfail_rank1.json").read_text())
    assert "No space left" in rank1["error"]
    assert "rank(s) [1] could not write" in rank0["error"]
    assert rank0["seconds"] < 30 and not rank0["manifest"]  # no wait for the 60 s timeout
