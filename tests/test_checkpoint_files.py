"""Checkpoint files that are not what they claim: refused, naming what is wrong, and never
read without bound (runtime/engine_checkpoint.py, runtime/ckpt_files.py).

* ``engine.pt`` a link to ``/dev/zero`` (or a FIFO): it used to be read without limit (the
  out-of-memory killer ended the process at 20.9 GB; a FIFO blocked for ever). Now refused
  without reading it, on load and by ``damaged`` (what ``--resume`` checks). Checked in a
  child process under a memory limit and a timeout, so the old behaviour fails the test
  instead of the machine.
* a file whose size is not the one ``meta.json`` records: refused without reading it;
* an ``engine.pt`` copied in from another save: it loaded that save with a warning blaming
  "a save killed between writing the two"; now refused, naming both saves;
* a save stopped between writing ``meta.json`` and renaming its file: the previous save
  loads, with a warning that says so;
* a pickle payload (even with a ``meta.json`` rewritten to match): ``CheckpointCorrupt``
  ("not a superoffload checkpoint, or tampered"), never torch's advice to pass
  ``weights_only=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _tiny_models import make_model

import superoffload as so
from superoffload.runtime import ckpt_manifest, engine_checkpoint
from superoffload.runtime.ckpt_files import CheckpointCorrupt

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CONFIG = so.OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.5, cpu_threads=1)


def _engine(seed: int = 0) -> tuple[torch.nn.Module, object]:
    model = make_model(seed=seed)
    return model, so.initialize(model, {"lr": 3e-3, "weight_decay": 0.1}, CONFIG)


def _train(model: torch.nn.Module, engine: object, steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        x = torch.randint(0, 61, (4, 12), generator=gen)
        engine.backward(model(x, torch.roll(x, -1, 1)))  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        engine.zero_grad()  # type: ignore[attr-defined]


def _saved(folder: Path, steps: int) -> None:
    model, engine = _engine()
    with engine:  # type: ignore[attr-defined]
        _train(model, engine, steps)
        engine.save_checkpoint(str(folder))  # type: ignore[attr-defined]


CHILD = r"""
import os, resource, sys, time
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
from _tiny_models import make_model
import superoffload as so
from superoffload.runtime import ckpt_manifest, engine_checkpoint
folder, kind = sys.argv[1], sys.argv[3]
model = make_model(seed=0)
engine = so.initialize(model, {"lr": 3e-3}, so.OffloadConfig(device="cpu", bucket_bytes=4096,
                       ratio=0.5, cpu_threads=1))
engine.save_checkpoint(folder)
file = os.path.join(folder, "engine.pt")
os.remove(file)
if kind == "dev-zero":
    os.symlink("/dev/zero", file)
else:
    os.mkfifo(file)  # a FIFO without a writer: opening it for reading blocks
# a bound on memory: reading /dev/zero into memory now fails at once instead of at 20 GB
with open("/proc/self/statm") as f:
    pages = int(f.read().split()[0])
limit = pages * os.sysconf("SC_PAGE_SIZE") + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
t0 = time.monotonic()
print("damaged:", ckpt_manifest.damaged(folder), flush=True)
try:
    engine.load_checkpoint(folder)
    print("loaded", flush=True)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
print(f"seconds: {time.monotonic() - t0:.2f}", flush=True)
os._exit(0)
"""


@pytest.mark.skipif(not os.path.exists("/dev/zero") or not hasattr(os, "mkfifo"),
                    reason="needs /dev/zero and FIFOs (POSIX)")
@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_file_that_is_not_regular_is_refused_without_reading_it(tmp_path: Path,
                                                                   kind: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt"),
                           str(Path(__file__).parent), kind], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 3, (proc.stdout, proc.stderr[-3000:])
    what = "a character device, a link to /dev/zero" if kind == "dev-zero" else "a FIFO"
    assert lines[0] == "damaged: engine.pt is not a regular file"
    assert lines[1].startswith("CheckpointCorrupt: checkpoint file ") and \
        f"engine.pt is not a regular file (it is {what}); it was not read" in lines[1], lines[1]
    assert float(lines[2].split()[1]) < 10.0  # answered, not read: well under a second here


def test_a_file_of_another_size_is_refused_without_reading_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    _saved(tmp_path / "ckpt", 2)
    file = tmp_path / "ckpt" / "engine.pt"
    size = file.stat().st_size
    with open(file, "ab") as f:
        f.write(b"\0" * 100)  # the zip still loads with bytes after its end
    reads: list[str] = []
    real_read = engine_checkpoint.read_regular
    monkeypatch.setattr(engine_checkpoint, "read_regular", lambda *a: (reads.append(a[0]),
                                                                real_read(*a))[1])
    model, engine = _engine()
    with engine, pytest.raises(CheckpointCorrupt) as info:  # type: ignore[attr-defined]
        engine.load_checkpoint(str(tmp_path / "ckpt"))  # type: ignore[attr-defined]
    assert reads == []
    message = str(info.value)
    assert f"engine.pt is not the file {tmp_path / 'ckpt' / 'meta.json'} describes " \
           f"(iteration 2, {size:,} bytes" in message
    assert f"it has {size + 100:,} bytes" in message and "it was not read" in message
    assert ckpt_manifest.damaged(str(tmp_path / "ckpt")) == \
        f"engine.pt has {size + 100:,} bytes, meta.json records {size:,} bytes"


def test_an_engine_pt_copied_from_another_save_is_refused_naming_both(tmp_path: Path) -> None:
    """The copied file is whole (its sealed checksum passes): it used to load, with a warning
    blaming "a save killed between writing the two"."""
    _saved(tmp_path / "a", 2)
    _saved(tmp_path / "b", 3)
    a_file = tmp_path / "a" / "engine.pt"
    if (tmp_path / "b" / "engine.pt").stat().st_size != a_file.stat().st_size:
        pytest.skip("the two saves differ in size here; the size test covers that case")
    shutil.copyfile(tmp_path / "b" / "engine.pt", a_file)
    model, engine = _engine()
    with engine, warnings.catch_warnings():  # type: ignore[attr-defined]
        warnings.simplefilter("error")
        with pytest.raises(CheckpointCorrupt) as info:
            engine.load_checkpoint(str(tmp_path / "a"))  # type: ignore[attr-defined]
    message = str(info.value)
    recorded = json.loads((tmp_path / "a" / "meta.json").read_text())["files"]["engine.pt"]
    theirs = hashlib.sha256(a_file.read_bytes()).hexdigest()
    assert f"meta.json records iteration 2, {recorded['bytes']:,} bytes, SHA-256 " \
           f"{recorded['sha256'][:12]}" in message
    assert f"engine.pt holds iteration 3, {a_file.stat().st_size:,} bytes, SHA-256 " \
           f"{theirs[:12]}" in message
    assert "copied in from another save; it was not loaded" in message
    assert "killed" not in message
    assert ckpt_manifest.damaged(str(tmp_path / "a")) == \
        "engine.pt does not match the SHA-256 its meta.json records"


def test_a_save_stopped_before_its_rename_loads_the_previous_one_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from superoffload.runtime import ckpt_files

    model, engine = _engine()
    with engine:  # type: ignore[attr-defined]
        _train(model, engine, 2)
        engine.save_checkpoint(str(tmp_path))  # type: ignore[attr-defined]
        want = engine.master_weights()  # type: ignore[attr-defined]
        _train(model, engine, 1)
        real_replace = os.replace

        def stopped(src: str, dst: str) -> None:
            if os.path.basename(dst) == "engine.pt":
                raise KeyboardInterrupt("stopped between meta.json and the rename")
            real_replace(src, dst)

        monkeypatch.setattr(ckpt_files.os, "replace", stopped)
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint(str(tmp_path))  # type: ignore[attr-defined]
        monkeypatch.undo()
    assert json.loads((tmp_path / "meta.json").read_text())["iteration"] == 3
    assert sorted(os.listdir(tmp_path)) == ["engine.pt", "meta.json"]  # no temporary left
    assert ckpt_manifest.damaged(str(tmp_path)) is None
    model, fresh = _engine(seed=1)
    with fresh, pytest.warns(RuntimeWarning, match=r"describes a save that did not finish "  # type: ignore[attr-defined]
                             r"\(iteration 3.*still holds the save before it \(iteration 2"):
        fresh.load_checkpoint(str(tmp_path))  # type: ignore[attr-defined]
        got = fresh.master_weights()  # type: ignore[attr-defined]
    assert fresh.iteration == 2  # type: ignore[attr-defined]
    assert all(torch.equal(want[k], got[k]) for k in want)


class Payload:
    """Stands for anything a pickle can carry: a checkpoint never holds a class instance."""

    def __init__(self) -> None:
        self.command = "echo pwned"


@pytest.mark.parametrize("meta", ["matching", "absent"])
def test_a_pickle_payload_is_not_a_checkpoint(tmp_path: Path, meta: str) -> None:
    _saved(tmp_path, 1)
    file = tmp_path / "engine.pt"
    torch.save({"format": engine_checkpoint.ENGINE_FORMAT, "extra": Payload()}, file)
    if meta == "matching":  # a tampered folder: meta.json rewritten to match the file
        record = json.loads((tmp_path / "meta.json").read_text())
        data = file.read_bytes()
        record["files"]["engine.pt"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                        "bytes": len(data)}
        (tmp_path / "meta.json").write_text(json.dumps(record))
    else:
        (tmp_path / "meta.json").unlink()
    model, engine = _engine()
    with engine, pytest.raises(CheckpointCorrupt) as info:  # type: ignore[attr-defined]
        engine.load_checkpoint(str(tmp_path))  # type: ignore[attr-defined]
    message = str(info.value)
    assert "not a superoffload checkpoint, or tampered; it was not loaded" in message
    assert "Payload" in message  # the object it carries
    assert "weights_only" not in message and info.value.__suppress_context__
