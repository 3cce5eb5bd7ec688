"""Bad command-line input is one argparse-style line naming the flag and the fix, exit code 2,
before anything is built or written (docs/failure_semantics.md, "Command line and
configuration")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from superoffload.cli import build_parser, main
from superoffload.commands.train_args import resolve_settings
from superoffload.commands.train_build import run_config
from superoffload.config import MIN_BUCKET_BYTES

TRAIN = "python -m superoffload train: error: "


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """Exit code and stderr lines of `python -m superoffload ARGV`, in this process."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's error(): usage line + error line, exit 2
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.strip().splitlines()


def _assert_one_error(code: int, lines: list[str], prefix: str, *fragments: str) -> None:
    assert code == 2, lines
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1, lines  # one error line (argparse adds a one-line usage above it)
    assert len(lines) <= 2 and not any("Traceback" in line for line in lines), lines
    assert errors[0].startswith(prefix), errors[0]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


@pytest.mark.parametrize(("argv", "fragments"), [
    (["--batch", "0"], ["argument --batch", "whole number >= 1"]),
    (["--seq", "0"], ["argument --seq", "whole number >= 1"]),
    (["--steps", "0"], ["argument --steps", "whole number >= 1"]),
    (["--batch", "two"], ["argument --batch", "not a whole number"]),
    (["--lr", "-1"], ["argument --lr", "negative", ">= 0"]),
    (["--lr", "nan"], ["argument --lr", "not a finite number"]),
    (["--lr", "inf"], ["argument --lr", "not a finite number"]),
    (["--weight-decay", "-0.1"], ["argument --weight-decay", "negative"]),
    (["--warmup", "-5"], ["argument --warmup", "negative", "whole number >= 0"]),
    (["--eval-batches", "-1"], ["argument --eval-batches", "negative"]),
    (["--device", "gpu"], ["argument --device", "'gpu' is not a device", "auto, cpu, cuda"]),
    (["--device", "cuda:x"], ["argument --device", "cuda:N"]),
    (["--bucket-mb", "nan"], ["argument --bucket-mb", "not a finite number"]),
    (["--bucket-mb", "-1"], ["argument --bucket-mb", f"minimum bucket of {MIN_BUCKET_BYTES}"]),
    (["--bucket-mb", "0.001"], ["argument --bucket-mb", f"minimum bucket of {MIN_BUCKET_BYTES}"]),
    (["--ratio", "1.5"], ["argument --ratio", "[0, 1]"]),
    (["--max-grad-norm", "nan"], ["argument --max-grad-norm", "finite"]),
    (["--out", ""], ["argument --out", "current folder"]),
    (["--checkpoint-every", "-1"], ["argument --checkpoint-every", "negative"]),
    (["--keep-checkpoints", "0"], ["argument --keep-checkpoints", ">= 1"]),
    (["--sample-temperature", "-1"], ["argument --sample-temperature", "negative"]),
    (["--sample-top-k", "-3"], ["argument --sample-top-k", "negative"]),
    # was accepted by one process, a raw C++ traceback under torchrun
    (["--dist-timeout-s", "0"], ["argument --dist-timeout-s", "seconds >= 1"]),
    (["--dist-timeout-s", "1e-9"], ["argument --dist-timeout-s", "seconds >= 1"]),
    (["--dist-timeout-s", "-5"], ["argument --dist-timeout-s", "seconds >= 1"]),
    (["--dist-timeout-s", "inf"], ["argument --dist-timeout-s", "not finite"]),
    (["--dist-timeout-s", "soon"], ["argument --dist-timeout-s", "not a number"]),
])
def test_bad_train_values_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                       fragments: list[str]) -> None:
    code, lines = _cli(capsys, "train", *argv)
    _assert_one_error(code, lines, TRAIN, *fragments)


@pytest.mark.parametrize("flag", ["--numel", "--repeats", "--threads"])
def test_bad_bench_counts_are_one_line(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    code, lines = _cli(capsys, "bench", "adam", flag, "0")
    _assert_one_error(code, lines, "python -m superoffload bench: error: ",
                      f"argument {flag}", "whole number >= 1")


def _parse(*argv: str) -> object:
    return build_parser().parse_args(["train", *argv])


def test_zero_is_kept_not_replaced_by_the_default() -> None:
    """`--lr 0` used to become 2e-3 (`args.lr or default`); now a given value is the value."""
    given = _parse("--lr", "0", "--max-grad-norm", "0", "--warmup", "0", "--eval-batches", "0",
                   "--weight-decay", "0")
    s = resolve_settings(given, "cpu")  # type: ignore[arg-type]
    got = (s.lr, s.max_grad_norm, s.warmup, s.eval_batches, s.weight_decay)
    assert got == (0.0, 0.0, 0, 0, 0.0)
    assert run_config(s, torch.device("cpu")).max_grad_norm is None  # 0 disables clipping
    d = resolve_settings(_parse(), "cpu")  # type: ignore[arg-type]
    assert (d.lr, d.batch, d.seq, d.steps, d.max_grad_norm) == (2e-3, 16, 128, 300, 1.0)


def test_bucket_mb_is_not_clamped() -> None:
    """The smallest accepted value is exactly MIN_BUCKET_BYTES, and it is used as given."""
    smallest = MIN_BUCKET_BYTES / (1 << 20)
    s = resolve_settings(_parse("--bucket-mb", repr(smallest)), "cpu")  # type: ignore[arg-type]
    assert run_config(s, torch.device("cpu")).bucket_bytes == MIN_BUCKET_BYTES
    s = resolve_settings(_parse("--bucket-mb", "1.5"), "cpu")  # type: ignore[arg-type]
    assert run_config(s, torch.device("cpu")).bucket_bytes == int(1.5 * (1 << 20))


def test_lr_times_weight_decay_must_stay_below_one(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    code, lines = _cli(capsys, "train", "--lr", "2", "--weight-decay", "0.5", "--device", "cpu",
                       "--out", str(tmp_path / "run"))
    _assert_one_error(code, lines, TRAIN, "--lr 2 x --weight-decay 0.5", "lower one")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_existing_file_or_non_empty_out_is_refused(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    code, lines = _cli(capsys, "train", "--out", str(a_file))
    _assert_one_error(code, lines, TRAIN, "argument --out", "existing file")
    run = tmp_path / "old_run"
    run.mkdir()
    (run / "result.json").write_text("{}")
    code, lines = _cli(capsys, "train", "--device", "cpu", "--out", str(run))
    _assert_one_error(code, lines, TRAIN, f"--out {run}", "not empty", "--resume")
    assert (run / "result.json").read_text() == "{}" and a_file.read_text() == "keep me"


def test_unwritable_out_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")  # a file where a folder would have to be: no user can write there
    code, lines = _cli(capsys, "train", "--device", "cpu", "--out", str(blocker / "run"))
    _assert_one_error(code, lines, TRAIN, f"--out {blocker / 'run'}", "cannot write there")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _cli(capsys, "train", "--device", "cuda")
    _assert_one_error(code, lines, TRAIN, "--device cuda", "use --device cpu")


def test_an_absurd_shape_is_refused_with_the_estimate(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """`train --seq 100000` raised GPT small's position table silently and its first
    step did not end in 10 minutes (2 cores, 24 GB): refused at once with the estimates."""
    import torch

    from superoffload.cli import build_parser
    from superoffload.commands import run_budget
    from superoffload.commands.train_args import resolve_settings

    monkeypatch.setattr(run_budget, "usable_cores", lambda: 2)  # this project's CI machine
    monkeypatch.setattr(run_budget, "host_memory_bytes", lambda: 24e9)
    # this machine's rates for GPT-2's kernels, as measured on 2 cores (one step ~4 min)
    monkeypatch.setattr(run_budget, "probe", lambda s: run_budget.Rates(4.0e10, 1.0e10))
    code, lines = _cli(capsys, "train", "--seq", "100000", "--device", "cpu")
    args = build_parser().parse_args(["train", "--seq", "100000"])
    est = run_budget.estimate(resolve_settings(args, "cpu"), torch.device("cpu"))
    _assert_one_error(code, lines, TRAIN, "--seq 100000 x --batch 16 is too large for this "
                      "machine", f"needs at least {est.memory_bytes / 1e9:.1f} GB of host "
                      "memory", "24.0 GB per rank", "6.2e+14 FLOPs, over 21 min per step even "
                      "at this machine's peak", "GPT small has 128 positions", "--checkpointing")
    # what the machine can do passes the check (and fails next, at the unwritable --out):
    # GPT-2's own shape, and a longer --seq for GPT small
    (tmp_path / "file").write_text("")
    for argv in (["--model", "gpt2", "--seq", "1024", "--batch", "8"],
                 ["--seq", "4096", "--batch", "4"]):
        code, lines = _cli(capsys, "train", *argv, "--device", "cpu",
                           "--out", str(tmp_path / "file" / "run"))
        _assert_one_error(code, lines, TRAIN, "cannot write there")


def test_resume_errors_name_the_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, lines = _cli(capsys, "train", "--resume", str(tmp_path / "nope"))
    _assert_one_error(code, lines, TRAIN, "--resume", "no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, lines = _cli(capsys, "train", "--resume", str(empty))
    _assert_one_error(code, lines, TRAIN, "--resume", "no complete checkpoint",
                      "--checkpoint-every")


def test_resume_of_a_python_api_checkpoint_is_explained(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    import superoffload as so
    from superoffload.models import GPT, gpt_tiny

    model = GPT(gpt_tiny())
    cfg = so.OffloadConfig(device="cpu", bucket_bytes=64 * 1024, ratio=0.5, cpu_threads=1)
    with so.initialize(model, optimizer={"lr": 1e-3}, config=cfg) as engine:
        engine.save_checkpoint(str(tmp_path / "ck"))
    code, lines = _cli(capsys, "train", "--resume", str(tmp_path / "ck"))
    _assert_one_error(code, lines, TRAIN, "train.json", "engine.load_checkpoint")


def test_errors_in_a_real_process_are_two_short_lines(tmp_path: Path) -> None:
    """No traceback, exit code 2: what a shell user sees (usage line + error line)."""
    for argv, flag in ((["train", "--out", ""], "--out"), (["bench", "adam", "--threads", "0"],
                                                           "--threads")):
        proc = subprocess.run([sys.executable, "-m", "superoffload", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 2, proc.stderr
        assert lines[0].startswith("usage: ") and f"argument {flag}" in lines[1]
    assert list(tmp_path.iterdir()) == []  # `--out ""` wrote nothing into the current folder


def test_writable_file_type_for_single_file_outputs(tmp_path: Path) -> None:
    """`argtypes.writable_file`: the check `tune --out` uses (commands/plan.py)."""
    import argparse

    from superoffload.commands.argtypes import writable_file

    assert writable_file(str(tmp_path / "tuned.json")) == tmp_path / "tuned.json"
    for bad, fragment in (("", "empty file name"), (str(tmp_path), "is a folder"),
                          (str(tmp_path / "no" / "x.json"), "does not exist")):
        with pytest.raises(argparse.ArgumentTypeError, match=fragment):
            writable_file(bad)
