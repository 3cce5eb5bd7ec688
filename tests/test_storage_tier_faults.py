"""The storage tier's faults: each a named error, nothing silently wrong, the last checkpoint
intact (docs/storage.md, "Faults"; docs/failure_semantics.md).

Full and read-only file systems are small mounts (tests run as root, where chmod stops
nothing; skipped, saying why, where mount is refused). A file deleted or truncated under a
running engine is done to the real tier file. ``kill -9`` in the middle of a write-back runs
in a child process killed from inside the write (deterministic, not a race).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from _engine_ref import HYPER, cpu_config, groups_for, max_diff
from _tiny_models import batches, make_model
from test_storage_aio_faults import mounted

import superoffload as so
from superoffload.runtime.errors import EngineError
from superoffload.runtime.tier_open import PREFIX, StorageNotice
from superoffload.storage.io_errors import StorageError

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tier(path: Path, **kw: object) -> so.OffloadConfig:
    return cpu_config(storage_path=str(path), ratio=0.7, storage_buffer_count=2, **kw)


def start(path: Path) -> tuple[torch.nn.Module, so.OffloadEngine]:
    model = make_model()
    return model, so.initialize(model, groups_for(model, False, HYPER), tier(path))


def step(model: torch.nn.Module, engine: so.OffloadEngine, batch: tuple) -> None:
    engine.backward(model(*batch))
    engine.step()
    engine.zero_grad()


def test_a_full_disk_fails_at_initialize_naming_the_folder_and_the_bytes(tmp_path: Path) -> None:
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=64k", "none") as folder:
        model = make_model()
        with pytest.raises(StorageError) as info:
            so.initialize(model, groups_for(model, False, HYPER), tier(folder))
        assert str(folder) in str(info.value) and "needs" in str(info.value)
        assert list(folder.iterdir()) == []  # nothing left behind
        p0 = next(model.parameters()).detach().clone()
        assert torch.equal(next(model.parameters()), p0)  # the model is untouched


def test_a_read_only_folder_fails_at_initialize_naming_it(tmp_path: Path) -> None:
    with mounted(tmp_path / "ro", "-t", "tmpfs", "-o", "ro,size=1m", "none") as folder:
        model = make_model()
        with pytest.raises((StorageError, so.ConfigError)) as info:
            so.initialize(model, groups_for(model, False, HYPER), tier(folder))
        assert str(folder) in str(info.value)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_tier_file_deleted_or_truncated_under_the_engine_is_named_and_the_checkpoint_stays(
        tmp_path: Path, damage: str) -> None:
    data, ckpt = batches(4), tmp_path / "ckpt"
    model, engine = start(tmp_path / "tier")
    step(model, engine, data[0])
    engine.save_checkpoint(str(ckpt))
    (tier_file,) = (tmp_path / "tier").glob(f"{PREFIX}*.bin")
    if damage == "delete":
        tier_file.unlink()
    else:
        os.truncate(tier_file, 4096)
    with pytest.raises(EngineError, match=tier_file.name):
        for batch in data[1:]:
            step(model, engine, batch)
    engine.close()
    # the checkpoint written before is whole: a new engine resumes from it
    model2, engine2 = start(tmp_path / "tier2")
    engine2.load_checkpoint(str(ckpt))
    assert engine2.iteration == 1
    step(model2, engine2, data[1])
    engine2.close()


def test_files_left_by_a_dead_run_are_removed_and_a_live_runs_file_is_kept(
        tmp_path: Path) -> None:
    folder = tmp_path / "tier"
    folder.mkdir()
    stale = folder / f"{PREFIX}999999-deadbeef-rank0.bin"
    stale.write_bytes(b"x" * 10_000)
    with pytest.warns(StorageNotice, match=f"removed 1 file.*{stale.name} .10,000 bytes"):
        _, live = start(folder)
    assert not stale.exists()  # nobody held it: removed, saying so
    (live_file,) = list(folder.iterdir())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, other = start(folder)  # the live engine's file is held: kept
    assert live_file.exists()
    assert not [w for w in seen if issubclass(w.category, StorageNotice)]
    other.close()
    live.close()
    assert not any(folder.iterdir())  # close() deletes each engine's own file


def test_an_unlocked_file_of_a_live_process_is_kept_and_of_a_zombie_removed(
        tmp_path: Path) -> None:
    # ranks sharing a folder start together: one may list the folder while another has
    # created its file but not yet locked it (open_tier creates, allocates, then locks); the
    # name's pid says it lives, so it is kept. A zombie holds no file: removed.
    import time

    from superoffload.runtime.tier_open import remove_stale

    folder = tmp_path / "tier"
    folder.mkdir()
    starting = folder / f"{PREFIX}{os.getpid()}-0123abcd-rank1.bin"
    starting.write_bytes(b"x" * 100)
    child = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 60
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        zombie = folder / f"{PREFIX}{child.pid}-0123abcd-rank0.bin"
        zombie.write_bytes(b"x" * 100)
        with pytest.warns(StorageNotice, match=zombie.name):
            removed = remove_stale(folder)
    finally:
        child.wait()
    assert removed == [f"{zombie.name} (100 bytes)"]
    assert starting.exists() and not zombie.exists()


def test_a_locked_file_is_kept_whatever_its_name_says(tmp_path: Path) -> None:
    # the lock is what a live engine on another host (a shared folder) or a reused pid leaves:
    # held, the file stays even when the pid in its name is not a process here
    import fcntl

    from superoffload.runtime.tier_open import remove_stale

    held = tmp_path / f"{PREFIX}999999-0123abcd-rank0.bin"
    held.write_bytes(b"x" * 100)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert remove_stale(tmp_path) == [] and held.exists()
    finally:
        os.close(fd)
    with pytest.warns(StorageNotice, match=held.name):
        assert remove_stale(tmp_path) == [f"{held.name} (100 bytes)"]  # released: stale


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from _engine_ref import HYPER, cpu_config, groups_for
from _tiny_models import batches, make_model
import superoffload as so
from superoffload.runtime import tier as tier_mod
data = batches(6)
model = make_model()
cfg = cpu_config(storage_path={folder!r}, ratio=0.7, storage_buffer_count=2, max_grad_norm=0.05)
engine = so.initialize(model, groups_for(model, False, HYPER), cfg)
for k in range(6):
    if k == 3:  # the first write-back of iteration 3 dies half-way through its file write
        real = tier_mod.StateTier.write_from
        def dying(self, b, slot, *, state, grad):
            region = self.books[b].region
            version = 1 - self.books[b].version
            half = region.state_bytes // 2
            self.io.write(self.file, region.state_offsets[version], slot.memory[:half]).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        tier_mod.StateTier.write_from = dying
    engine.backward(model(*data[k]))
    engine.step()
    engine.zero_grad()
    if k + 1 == 2:
        engine.save_checkpoint({ckpt!r})
"""

RESUMED = """
import sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from _engine_ref import HYPER, cpu_config, groups_for
from _tiny_models import batches, make_model
import superoffload as so
data = batches(6)
model = make_model()
cfg = cpu_config(storage_path={folder!r}, ratio=0.7, storage_buffer_count=2, max_grad_norm=0.05)
engine = so.initialize(model, groups_for(model, False, HYPER), cfg)
if {ckpt!r}:
    engine.load_checkpoint({ckpt!r})
for k in range(engine.iteration, 5):
    engine.backward(model(*data[k]))
    engine.step()
    engine.zero_grad()
torch.save(engine.master_weights(), {out!r})
engine.close()
"""


def test_kill_9_during_a_write_back_then_resume_equals_the_uninterrupted_run(
        tmp_path: Path) -> None:
    tests, folder, ckpt = str(Path(__file__).parent), str(tmp_path / "tier"), str(tmp_path / "c")
    killed = subprocess.run([sys.executable, "-c", KILLED.format(
        tests=tests, folder=folder, ckpt=ckpt)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert any(Path(folder).glob(f"{PREFIX}*.bin"))  # the dead run's torn file is left
    for ck, out in ((ckpt, "resumed.pt"), ("", "straight.pt")):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(RESUMED.format(
            tests=tests, folder=folder, ckpt=ck, out=str(tmp_path / out)))],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    resumed = torch.load(tmp_path / "resumed.pt")
    straight = torch.load(tmp_path / "straight.pt")
    assert max_diff(resumed, straight) == 0.0  # bit-identical to the run never killed
    assert len(list(Path(folder).glob(f"{PREFIX}*.bin"))) == 0  # the stale file went too
