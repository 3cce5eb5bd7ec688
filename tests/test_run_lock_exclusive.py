"""The run lock is exclusive however it is taken (commands/run_lock.py).

A run folder an earlier run used keeps its lock file (the kernel drops the ``flock`` when
that run ends, the file stays). The next run takes that existing file over; a shared lock
there would let two runs hold the folder at once, each overwriting the other's checkpoints.
Here a second process holds the lock it took over from a leftover file, and this process
must be refused, naming the holder's pid; once the holder ends, the folder is free again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from superoffload.commands.run_lock import LOCK_NAME, lock_run_folder, release_all
from superoffload.commands.train_args import UsageError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

HOLD = """
import sys
from pathlib import Path
from superoffload.commands.run_lock import lock_run_folder
lock_run_folder(Path(sys.argv[1]), "--out holder")
print("held", flush=True)
sys.stdin.read()  # hold until the test closes our stdin
"""


@pytest.mark.parametrize("leftover", [True, False])
def test_a_held_folder_is_refused_whether_or_not_its_lock_file_existed(tmp_path: Path,
                                                                       leftover: bool) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    if leftover:  # what an earlier run leaves: its record, no flock
        (folder / LOCK_NAME).write_text("4194301 some-host\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"another `superoffload train` run \(pid "
                                             rf"{holder.pid}\) is using the run folder"):
            lock_run_folder(folder, "--out run")
    finally:
        release_all()  # had this process taken it, let go before the holder ends
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    lock_run_folder(folder, "--out run")  # the holder ended: the folder is free
    release_all()
