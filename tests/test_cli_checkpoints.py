"""The run folder's checkpoints (`superoffload.commands.checkpointing`): atomic folders, the
`latest` pointer, keeping the newest K, what --resume picks, and a full disk that loses
neither the run nor its result.json and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from superoffload.commands import checkpointing as ck
from superoffload.commands.train_args import UsageError

RUN = {"model": "tiny", "steps": 10}


class FakeEngine:
    """Writes an engine.pt like the engine does (the file is what is_checkpoint() looks for);
    `fail` makes the write die half-way, as a full disk does."""

    def __init__(self) -> None:
        self.fail: BaseException | None = None
        self.saved: list[tuple[str, Any]] = []

    def save_checkpoint(self, path: str, extra: Any = None, *, lr_scheduler: Any = None) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "engine.pt.tmp-1").write_bytes(b"half")
        if self.fail is not None:
            raise self.fail
        (Path(path) / "engine.pt.tmp-1").rename(Path(path) / "engine.pt")
        self.saved.append((path, extra))
        return path


def _extra(step: int) -> dict[str, Any]:
    return {"format": ck.RUN_FORMAT, "run": RUN, "samplers": [{}],
            "progress": {"step": step, "losses": [1.0] * step, "lrs": [0.1] * step, "tokens": step}}


def test_periodic_checkpoints_are_atomic_pointed_and_pruned(tmp_path: Path) -> None:
    runs = ck.RunCheckpoints(tmp_path, keep=2)
    engine = FakeEngine()
    for step in (5, 10, 15):
        runs.save_step(engine, extra=_extra(step), scheduler=None)
    names = sorted(p.name for p in runs.folder.iterdir())
    assert names == [ck.LATEST, "step-000010", "step-000015"]  # the newest 2 kept
    assert (runs.folder / ck.LATEST).read_text() == "step-000015\n"
    meta = json.loads((runs.folder / "step-000015" / ck.TRAIN_JSON).read_text())
    assert meta == {"format": ck.RUN_FORMAT, "step": 15, "run": RUN, "kind": "single"}
    # every save went to a partial folder first, renamed when complete
    assert [Path(p).name for p, _ in engine.saved] == [".partial-step-0000" + s
                                                       for s in ("05", "10", "15")]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("PytorchStreamWriter failed writing file")])
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path: Path,
                                                             error: BaseException) -> None:
    runs = ck.RunCheckpoints(tmp_path, keep=2)
    engine = FakeEngine()
    runs.save_step(engine, extra=_extra(5), scheduler=None)
    engine.fail = error
    with pytest.raises(type(error)):
        runs.save_step(engine, extra=_extra(10), scheduler=None)
    assert sorted(p.name for p in runs.folder.iterdir()) == [ck.LATEST, "step-000005"]
    assert (runs.folder / ck.LATEST).read_text() == "step-000005\n"
    point = ck.find_resume_point(tmp_path)
    assert (point.path.name, point.step, point.run_folder) == ("step-000005", 5, tmp_path)


def test_resume_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    runs = ck.RunCheckpoints(tmp_path, keep=3)
    engine = FakeEngine()
    for step in (4, 8):
        runs.save_step(engine, extra=_extra(step), scheduler=None)
    (runs.folder / "step-000012").mkdir()  # no engine file: an incomplete copy is skipped
    assert ck.find_resume_point(tmp_path).step == 8
    assert ck.find_resume_point(runs.folder).step == 8
    assert ck.find_resume_point(runs.folder / "step-000004").step == 4  # named explicitly
    (runs.folder / ck.LATEST).unlink()  # without the pointer: the highest complete step
    assert ck.find_resume_point(tmp_path).step == 8
    runs.save(engine, tmp_path / "checkpoint", extra=_extra(10), scheduler=None)
    final = ck.find_resume_point(tmp_path)  # the final checkpoint is newer than step 8
    assert (final.path.name, final.step, final.run_folder) == ("checkpoint", 10, tmp_path)
    (tmp_path / "checkpoint" / ck.TRAIN_JSON).write_text("{not json")
    with pytest.raises(UsageError, match="damaged"):
        ck.find_resume_point(tmp_path / "checkpoint")


def test_clean_partials_removes_leftovers_only(tmp_path: Path) -> None:
    runs = ck.RunCheckpoints(tmp_path)
    runs.save_step(FakeEngine(), extra=_extra(3), scheduler=None)
    for p in (runs.folder / ".partial-step-000009", tmp_path / ".partial-checkpoint"):
        p.mkdir(parents=True)
    runs.clean_partials()
    assert sorted(p.name for p in runs.folder.iterdir()) == [ck.LATEST, "step-000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


# ---------------------------------------------------------------- a full disk, for real
FULL_DISK = """
import errno, sys, torch
real_save = torch.save
def full_disk(obj, f, *args, **kwargs):  # half a file, then the disk is full
    f.write(b"\\0" * 1000)
    raise {error}
torch.save = full_disk
from superoffload.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("error", ["OSError(errno.ENOSPC, 'No space left on device')",
                                   "RuntimeError('PytorchStreamWriter failed writing file "
                                   "data/0: file write failed')"])
def test_full_disk_keeps_the_run_its_result_and_report(tmp_path: Path, error: str) -> None:
    """Every checkpoint write fails: training goes on (one warning line per periodic save),
    the final save's failure is one line and exit code 1, and result.json and the report
    are written anyway; no partial folder or temporary file is left."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK.format(error=error), "train", "--model", "tiny",
         "--steps", "4", "--batch", "2", "--seq", "16", "--eval-batches", "1", "--device", "cpu",
         "--checkpoint-every", "2", "--save-checkpoint", "--quiet", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    warnings = [x for x in lines if x.startswith("train: checkpoint at step")]
    assert len(warnings) == 2 and "training continues" in warnings[0]
    assert lines[-1].startswith("train: the final checkpoint was not written (")
    assert f"result.json and the report are in {out}" in lines[-1]
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 4 and len(result["checkpoint_errors"]) == 2
    assert "checkpoint" in result["final_checkpoint_error"]
    assert (out / "report.html").stat().st_size > 0
    leftovers = [p for p in out.rglob("*") if ".partial" in p.name or ".tmp" in p.name]
    assert leftovers == [] and not (out / "checkpoint").exists()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


# ---------------------------------------------------------------- --resume's settings
def _args(*argv: str) -> Any:
    from superoffload.cli import build_parser

    return build_parser().parse_args(["train", *argv])


def test_resume_settings_come_from_the_checkpoint_and_numerics_cannot_change() -> None:
    from superoffload.commands.train_args import resolve_settings

    given = _args("--model", "tiny", "--lr", "0.01", "--steps", "50", "--batch", "4",
                  "--ratio", "0.25")
    saved = resolve_settings(given, "cpu").to_dict()
    again = resolve_settings(_args(), "cpu", saved=saved)  # nothing given: the checkpoint's run
    assert again.to_dict() == saved
    moved = resolve_settings(_args("--ratio", "1.0", "--eval-batches", "0"), "cpu", saved=saved)
    assert (moved.ratio, moved.eval_batches, moved.lr) == (1.0, 0, 0.01)  # placement may change
    with pytest.raises(UsageError, match=r"--lr 0\.02 differs from the checkpoint's run \(0\.01\)"):
        resolve_settings(_args("--lr", "0.02"), "cpu", saved=saved)
    with pytest.raises(UsageError, match="--steps 60 differs"):
        resolve_settings(_args("--steps", "60"), "cpu", saved=saved)
    with pytest.raises(UsageError, match="this launch has dp=2"):
        resolve_settings(_args(), "cpu", dp=2, saved=saved)


def test_a_finished_run_is_not_resumed_into_its_own_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from superoffload.cli import main

    runs = ck.RunCheckpoints(tmp_path / "run")
    runs.save_step(FakeEngine(), extra=_extra(10), scheduler=None)  # RUN has steps=10
    assert main(["train", "--resume", str(tmp_path / "run"), "--device", "cpu"]) == 2
    assert "at step 10 of 10; that run is complete" in capsys.readouterr().err
    done = ck.RunCheckpoints(tmp_path / "done")
    done.save_step(FakeEngine(), extra=_extra(4), scheduler=None)
    (tmp_path / "done" / "result.json").write_text("{}")
    with pytest.raises(UsageError, match="has finished .* add --out NEW_FOLDER"):
        ck.prepare_run_folder(None, ck.find_resume_point(tmp_path / "done"))
    assert (tmp_path / "done" / "result.json").read_text() == "{}"
    elsewhere = ck.prepare_run_folder(tmp_path / "branch", ck.find_resume_point(tmp_path / "done"))
    assert elsewhere == tmp_path / "branch" and elsewhere.is_dir()
