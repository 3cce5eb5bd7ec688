"""Checkpoints of a `train` run: every N steps, on SIGINT/SIGTERM, at the end, and --resume.

Layout of a run folder::

    <out>/checkpoints/step-000040/   an engine checkpoint (engine.pt + meta.json; under
    <out>/checkpoints/step-000060/   torchrun one file per rank + manifest.json) and
                                     train.json (the run's settings and step)
    <out>/checkpoints/latest         the name of the newest complete one
    <out>/checkpoint/                the final one (--save-checkpoint)
    <out>/.superoffload-run.lock     held by the run using the folder (commands/run_lock.py)

Atomic at the folder level: a checkpoint is written into ``.partial-<name>`` next to its
final name and renamed once complete; then ``latest`` is replaced through a temporary file
(``os.replace``), then checkpoints beyond the newest K are removed. A kill at any moment
leaves the previous checkpoint and ``latest`` intact, plus a ``.partial-*`` folder that the
next run in that folder removes. The engine itself writes each of its files atomically
(``runtime/engine_checkpoint.py``, ``distributed/fsdp/checkpoint.py``).

What a checkpoint holds besides the engine (model, optimizer state, loss scaler, STV state,
counters, each rank's RNG, the LR scheduler): ``extra`` = the run's settings, its
`train_loop.Progress` (step, losses, learning rates, tokens) and every rank's batch-sampler
state, so `--resume` continues bit for bit where the run stopped.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from superoffload.commands.run_lock import lock_run_folder
from superoffload.commands.signals import signal_name
from superoffload.commands.train_args import UsageError, check_out, make_out
from superoffload.train_loop import Progress

RUN_FORMAT = "superoffload-train/1"
TRAIN_JSON = "train.json"
LATEST = "latest"
PARTIAL = ".partial-"
_STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A complete engine checkpoint: the single engine's file or the data-parallel
    (DCP) checkpoint's manifest."""
    return (path / "engine.pt").is_file() or (path / "manifest.json").is_file()


def checkpoint_kind(path: Path) -> str:
    """"zero" (sharded, written under torchrun) or "single"."""
    return "zero" if (path / "manifest.json").is_file() else "single"


# ---------------------------------------------------------------- writing
@dataclass(frozen=True, slots=True)
class RunCheckpoints:
    """Where and how one run writes its checkpoints. `save()` is collective under torchrun
    (every rank calls it; `lead` is rank 0, the one that renames, points and prunes)."""

    out: Path
    keep: int = 2
    lead: bool = True

    @property
    def folder(self) -> Path:
        return self.out / "checkpoints"

    def clean_partials(self) -> None:
        """Remove what killed saves left behind (call on the lead before any rank saves)."""
        for parent in (self.out, self.folder):
            if parent.is_dir():
                for p in parent.glob(PARTIAL + "*"):
                    shutil.rmtree(p, ignore_errors=True)

    def save(self, engine: Any, final: Path, *, extra: dict[str, Any], scheduler: Any) -> Path:
        """Write `engine`'s checkpoint (plus train.json) into `final` atomically. On any
        error the partial folder is removed and the error re-raised; `final` and `latest`
        are untouched. (Every rank's engine creates the partial folder as it saves.)"""
        partial = final.parent / (PARTIAL + final.name)
        try:
            engine.save_checkpoint(str(partial), extra=extra, lr_scheduler=scheduler)
            # rank 0 renames only now: the save's last barrier follows the manifest on every rank
            if self.lead:
                _write_json(partial / TRAIN_JSON, {
                    "format": RUN_FORMAT, "step": extra["progress"]["step"],
                    "run": extra["run"], "kind": checkpoint_kind(partial)})
                _replace_dir(partial, final)
        except BaseException:
            # a full disk raises OSError, or RuntimeError from torch.save
            if self.lead:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        return final

    def save_step(self, engine: Any, *, extra: dict[str, Any], scheduler: Any) -> Path:
        """A periodic (or on-signal) checkpoint: `checkpoints/step-N`, then `latest`, then
        pruning to the newest `keep`."""
        final = self.folder / step_name(int(extra["progress"]["step"]))
        self.save(engine, final, extra=extra, scheduler=scheduler)
        if self.lead:
            _write_text(self.folder / LATEST, final.name + "\n")
            steps = sorted((int(m.group(1)), p) for p in self.folder.iterdir()
                           if (m := _STEP.match(p.name)) and p.is_dir())
            for _, old in steps[:-self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        return final


def _replace_dir(partial: Path, final: Path) -> None:
    """Rename `partial` to `final` (atomic); an existing `final` is moved aside first."""
    old = final.parent / (PARTIAL + "old-" + final.name)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX: fsync the directory holding the entry)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=1) + "\n")


class CheckpointFailed(RuntimeError):
    """A periodic checkpoint of a data-parallel run could not be written (fatal there: the
    ranks must agree on every collective, docs/failure_semantics.md)."""


# ---------------------------------------------------------------- reading (--resume)
@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint --resume names, read before anything is built."""

    path: Path
    kind: str
    """"single" or "zero"."""
    step: int
    run: dict[str, Any]
    """The settings of the run that wrote it (train_args.RunSettings.to_dict())."""
    run_folder: Path | None
    """The run folder it belongs to (<run>/checkpoints/step-N or <run>/checkpoint)."""
    skipped: tuple[tuple[Path, str], ...] = ()
    """Newer checkpoints passed over because they are damaged: (folder, why)."""

    def fallback_warning(self, arg: Path) -> str | None:
        """The one line saying that a newer checkpoint was damaged, naming both; or None."""
        if not self.skipped:
            return None
        newest, why = self.skipped[0]
        more = f" (and {len(self.skipped) - 1} more)" if len(self.skipped) > 1 else ""
        return (f"train: warning: --resume {arg}: the newest checkpoint {newest} is damaged "
                f"({why}){more}; resuming from {self.path} (step {self.step}), the newest "
                "complete verified one")


def _read_train_json(path: Path) -> tuple[int, dict[str, Any]]:
    """(step, run settings) of checkpoint folder ``path``'s train.json. OSError when it cannot
    be read (FileNotFoundError: there is none); ValueError, KeyError or TypeError when it is
    damaged (not JSON, another format, no step or run)."""
    meta = json.loads((path / TRAIN_JSON).read_text())
    if meta.get("format") != RUN_FORMAT:
        raise ValueError(f"format {meta.get('format')!r}, expected {RUN_FORMAT!r}")
    return int(meta["step"]), dict(meta["run"])


def damaged(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed, in a few words; None when it is
    complete and its files match the SHA-256 their manifest recorded (read once more here,
    before anything is built: a torn or flipped checkpoint is passed over, not loaded)."""
    try:
        _read_train_json(path)
    except FileNotFoundError:
        return f"no {TRAIN_JSON}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {TRAIN_JSON} is damaged: {exc}"
    if checkpoint_kind(path) == "single":
        from superoffload.runtime.ckpt_manifest import damaged as engine_damaged

        return engine_damaged(str(path))
    from superoffload.runtime.ckpt_files import check_digests

    try:
        # the sharded format (distributed/fsdp/checkpoint.py): every file's SHA-256
        manifest = json.loads((path / "manifest.json").read_text())
        digests = {name: str(manifest["sha256"][name]) for name in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest.json is damaged: {exc!r}"
    return check_digests(str(path), digests)


def find_resume_point(arg: Path) -> ResumePoint:
    """Resolve --resume DIR: a run folder (its newest complete, verified checkpoint among
    `latest`, the step-N ones and the final one), its checkpoints/ folder, or a checkpoint
    folder. UsageError when nothing usable is there; a damaged newest checkpoint is passed
    over (``ResumePoint.skipped``; the caller warns)."""
    path, skipped = _locate(arg)
    meta_file = path / TRAIN_JSON
    if not meta_file.is_file():
        raise UsageError(f"--resume {arg}: {path} holds an engine checkpoint but no "
                         f"{TRAIN_JSON}, so it was not written by `superoffload train`; "
                         "load it from Python with engine.load_checkpoint()")
    try:
        step, run = _read_train_json(path)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--resume {arg}: {meta_file} is damaged ({exc}); resume from an "
                         "older checkpoint in the same folder") from None
    if path.parent.name == "checkpoints":
        run_folder: Path | None = path.parent.parent
    elif path.name == "checkpoint":
        run_folder = path.parent
    else:
        run_folder = None
    return ResumePoint(path, checkpoint_kind(path), step, run, run_folder, skipped)


def _locate(arg: Path) -> tuple[Path, tuple[tuple[Path, str], ...]]:
    """The checkpoint --resume names: the folder itself (refused when damaged), else the
    newest complete and verified one of its periodic checkpoints (`latest` first among
    equals) and its final one; with the newer ones it passed over and why."""
    if not arg.is_dir():
        raise UsageError(f"--resume {arg}: no such folder; give a run folder (runs/<name>) "
                         "or a checkpoint folder")
    if is_checkpoint(arg):
        # no train.json (saved from Python) is not damage: find_resume_point says what to do
        why = damaged(arg) if (arg / TRAIN_JSON).is_file() else None
        if why is not None:
            raise UsageError(f"--resume {arg}: this checkpoint is damaged ({why}); resume "
                             "from an older one, or give the run folder to use its newest "
                             "complete one")
        return arg, ()
    found = _periodic(arg / "checkpoints") + _periodic(arg) + (
        [arg / "checkpoint"] if is_checkpoint(arg / "checkpoint") else [])
    if not found:
        raise UsageError(f"--resume {arg}: no complete checkpoint there (expected "
                         "checkpoints/step-N/, checkpoint/, or a folder holding engine.pt or "
                         "manifest.json); train with --checkpoint-every N to write them")
    skipped: list[tuple[Path, str]] = []
    # newest first; the stable sort keeps `latest` ahead of an equal step
    for path in sorted(found, key=_step_of, reverse=True):
        why = damaged(path)
        if why is None:
            return path, tuple(skipped)
        skipped.append((path, why))
    newest, why = skipped[0]
    # saved from Python: find_resume_point explains that
    if why == f"no {TRAIN_JSON}":
        return newest, ()
    raise UsageError(f"--resume {arg}: every checkpoint there is damaged (the newest, {newest}: "
                     f"{why}); start a new run without --resume")


def _periodic(folder: Path) -> list[Path]:
    """The complete step-N checkpoints in ``folder``, the one `latest` names first."""
    if not folder.is_dir():
        return []
    steps = [p for p in sorted(folder.glob("step-*"), reverse=True)
             if _STEP.match(p.name) and is_checkpoint(p)]
    pointer = folder / LATEST
    if pointer.is_file():
        named = folder / pointer.read_text().strip()
        if named in steps:
            steps.remove(named)
            steps.insert(0, named)
    return steps


def _step_of(path: Path) -> int:
    try:
        return int(json.loads((path / TRAIN_JSON).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def run_extra(extra: Any, path: Path) -> tuple[Progress, list[Any]]:
    """(progress, sampler states by rank) from a loaded checkpoint's `extra`."""
    if not isinstance(extra, dict) or extra.get("format") != RUN_FORMAT:
        raise UsageError(f"--resume {path}: the checkpoint's extra payload is not a "
                         "`superoffload train` record; it cannot be resumed from the command line")
    return Progress.from_dict(extra["progress"]), list(extra["samplers"])


# ---------------------------------------------------------------- SIGINT / SIGTERM
def checkpoint_on_stop(ckpts: RunCheckpoints, engine: Any, *, step: int, steps: int, signum: int,
                       saved_step: int | None, extra: Callable[[], dict[str, Any]],
                       scheduler: Any, launch: str) -> dict[str, Any]:
    """A signal stopped the loop after `step`: write that step's checkpoint (unless the
    periodic one just did; collective under torchrun) and return the record the CLI prints
    (`message`, one line) and exits with (`exit_code`, 128 + the signal, as a shell does)."""
    from superoffload.commands.train_output import one_line

    path, error = ckpts.folder / step_name(step), None
    if saved_step != step:
        try:
            ckpts.save_step(engine, extra=extra(), scheduler=scheduler)
        except Exception as exc:
            # say so, and point at the newest checkpoint that exists
            error = one_line(exc)
    name = signal_name(signum)
    if error is None:
        message = (f"train: stopped by {name} after step {step} of {steps}; checkpoint saved "
                   f"in {path}; continue with: {launch} --resume {ckpts.out}")
    else:
        message = (f"train: stopped by {name} after step {step} of {steps}; its checkpoint "
                   f"could not be written ({error}); continue from the newest one with: "
                   f"{launch} --resume {ckpts.out}")
    return {"signal": name, "exit_code": 128 + signum, "step": step,
            "checkpoint": None if error else str(path), "message": message}


# ---------------------------------------------------------------- the run folder
def _default_out() -> Path:
    runs = Path("runs")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = runs / stamp, 1
    # mkdir claims the name: two runs started in the same second get two
    while True:
        try:
            out.mkdir(parents=True)
            break
        except FileExistsError:
            out, n = runs / f"{stamp}-{n}", n + 1
        except OSError:
            # make_out says why
            break
    make_out(out)
    latest = runs / "latest"
    # best effort: a convenience link, not needed by anything
    with contextlib.suppress(OSError):
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name)
    return out


def prepare_run_folder(out: Path | None, resume: ResumePoint | None) -> Path:
    """The run folder, made and locked for this run (call on rank 0 only): --out, else the
    resumed run's folder, else runs/<timestamp> (linked as runs/latest). Leftovers of killed
    saves are removed. A folder another live run holds is refused, naming its pid
    (`run_lock`); the lock is let go by `run_lock.release_all()` when the run ends."""
    resume_run = resume.run_folder if resume is not None else None
    if out is not None:
        if out.exists() and not out.is_dir():
            # a file there: refused
            check_out(out, resume_run)
        folder = make_out(out)
        # before it is checked: a race has one winner
        lock_run_folder(folder, f"--out {out}")
        check_out(out, resume_run)
    elif resume_run is not None:
        folder = make_out(resume_run)
        lock_run_folder(folder, f"--resume {resume.path if resume else resume_run}")
    else:
        folder = _default_out()
        lock_run_folder(folder, str(folder))
    if resume_run is not None and folder.resolve() == resume_run.resolve() \
            and (folder / "result.json").exists():
        raise UsageError(f"--resume: the run in {folder} has finished (its result.json is "
                         "there) and would be overwritten; to train on from one of its "
                         "checkpoints, add --out NEW_FOLDER")
    RunCheckpoints(folder).clean_partials()
    return folder
