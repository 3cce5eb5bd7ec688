"""`train` sizes absurd for this machine are refused up front with the estimate, and a
signal during the final evaluation stops the process at once (commands/run_budget.py,
commands/signals.py).

* `train --model tiny --steps 2 --seq 100000` (the docs' own example of a refused shape,
  with the tiny model) had not finished a step after 200 s: its bound at the peak rate (6
  min a step) passed, while the real kernels run it at about 2 h a step. The bound is now
  followed by a measurement of this machine's rates for the model's own kernels.
* `--eval-batches 100000` never got past its 2 steps (hours of evaluation, no word).
* SIGTERM during that evaluation said "finishing the current step" and lived on.

The refusals in real processes run with one thread (`OMP_NUM_THREADS=1`), so the measured
rates are one core's on any machine: hours, far beyond the limits, whatever the machine.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from superoffload.cli import build_parser, main
from superoffload.commands import run_budget
from superoffload.commands.train_args import RunSettings, resolve_settings

TIMEOUT_S = 180
TRAIN = "python -m superoffload train: error: "


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)


def _refused(tmp_path: Path, *argv: str) -> str:
    """The one error line of a real `train` process that must be refused at once."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "superoffload", "train", *argv, "--device",
                           "cpu", "--out", str(out)], cwd=tmp_path, env=_env(), text=True,
                          capture_output=True, timeout=TIMEOUT_S)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert not out.exists()  # refused before anything was made
    return lines[0]


def test_tiny_with_seq_100000_is_refused_with_the_estimate(tmp_path: Path) -> None:
    line = _refused(tmp_path, "--model", "tiny", "--steps", "2", "--seq", "100000")
    assert line.startswith(TRAIN + "--seq 100000 x --batch 16 is too large for this machine: "
                           "one step needs 1.9e+14 FLOPs, about "), line
    about = line.split("one step needs 1.9e+14 FLOPs, about ")[1].split(" per step")[0]
    number, unit = about.split()
    seconds = float(number) * {"h": 3600.0, "min": 60.0, "s": 1.0}[unit]
    assert seconds > run_budget.MAX_STEP_S, line  # hours on one core; the limit is 10 min
    assert "per step at the rates this machine reached for the model's matrix products (" \
        in line and "GPT tiny has 64 positions" in line


def test_eval_batches_100000_is_refused_with_the_estimate(tmp_path: Path) -> None:
    line = _refused(tmp_path, "--model", "tiny", "--steps", "2", "--eval-batches", "100000")
    assert line.startswith(TRAIN + "--eval-batches 100000: the final evaluation would take "
                           "about "), line
    assert "(100000 forwards of 16 x 128 tokens at the rates this machine reached" in line
    assert "longer than 2 min and than the 2 training steps" in line
    fits = int(line.split("use --eval-batches ")[1].split()[0])
    assert 0 < fits < 100000


def _settings(*argv: str) -> RunSettings:
    return resolve_settings(build_parser().parse_args(["train", *argv]), "cpu")


def test_the_estimate_uses_the_measured_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values, with the probe replaced by known rates: the step is the matrix products'
    FLOPs over their rate plus attention's over its own; the evaluation a third of a step
    per batch. Short runs are never measured (the probe is not called)."""
    monkeypatch.setattr(run_budget, "usable_cores", lambda: 2)
    rates = run_budget.Rates(dense=2.0e10, attention=5.0e9)
    calls: list[int] = []
    monkeypatch.setattr(run_budget, "probe", lambda s: (calls.append(1), rates)[1])
    cpu = torch.device("cpu")
    s = _settings("--model", "tiny", "--seq", "100000", "--steps", "2")
    est = run_budget.measured(s, cpu)
    assert calls == [1] and est.measured == rates
    want = est.dense_flops / 2.0e10 + est.attention_flops / 5.0e9
    assert est.step_s == pytest.approx(want, rel=1e-12) and est.step_s > est.peak_step_s
    with pytest.raises(run_budget.UsageError, match=f"about {run_budget.duration(want)} per "
                       r"step at the rates this machine reached for the model's matrix "
                       r"products \(20\.0 GFLOP/s\) and attention \(5\.0 GFLOP/s\)"):
        run_budget.check_budget(s, cpu)
    s = _settings("--model", "tiny", "--steps", "2", "--eval-batches", "100000")
    est = run_budget.measured(s, cpu)
    assert est.eval_s(100000) == pytest.approx(100000 * est.step_s / 3, rel=1e-12)
    fits = int(run_budget.MAX_EVAL_S / est.eval_s(1))
    with pytest.raises(run_budget.UsageError, match=f"use --eval-batches {fits} or fewer"):
        run_budget.check_budget(s, cpu)
    s = _settings("--model", "tiny", "--steps", "2", "--eval-batches", str(fits))
    run_budget.check_budget(s, cpu)  # at the limit: passes
    calls.clear()
    for argv in ([], ["--model", "gpt2", "--seq", "256"], ["--seq", "4096", "--batch", "4"]):
        run_budget.check_budget(_settings(*argv), cpu)  # the defaults and the like: unmeasured
    assert calls == []


def test_eval_batches_100000_with_batch_2_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--eval-batches 100000 --batch 2` (GPT small, 300 steps) was accepted on a machine of
    many cores: 3 s at their peak, under the probe threshold, and 15-34 min of evaluation in
    fact (a forward of 2 x 128 tokens uses a core or two). It outweighs the training (more
    forwards than three per step), so it is measured, whatever the cores, and refused: about
    12 min here against 2 (a busy machine only makes it longer)."""
    monkeypatch.setattr(run_budget, "usable_cores", lambda: 64)
    s = _settings("--eval-batches", "100000", "--batch", "2")
    assert s.model == "small" and s.steps == 300
    with pytest.raises(run_budget.UsageError, match=r"^--eval-batches 100000: the final "
                       r"evaluation would take about .* \(100000 forwards of 2 x 128 tokens at "
                       r"the rates this machine reached .*; use --eval-batches \d+ or fewer"):
        run_budget.check_budget(s, torch.device("cpu"))


def test_an_evaluation_is_measured_exactly_when_it_outweighs_the_training(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Values, with the probe replaced by known rates and a 2 ms fixed cost per forward: an
    evaluation of more forwards than three per training step is measured however short it
    is at the peak, one of at most three per step never is; the fixed cost counts a forward
    once per evaluation batch and three times per training step, and the count the error
    offers passes while one more is refused."""
    monkeypatch.setattr(run_budget, "usable_cores", lambda: 2)
    rates = run_budget.Rates(dense=2.0e10, attention=5.0e9, forward_fixed_s=2e-3)
    calls: list[int] = []
    monkeypatch.setattr(run_budget, "probe", lambda s: (calls.append(1), rates)[1])
    cpu = torch.device("cpu")
    for steps, batches, probed in ((10, 30, False), (10, 31, True), (300, 100000, True)):
        calls.clear()
        s = _settings("--model", "tiny", "--batch", "1", "--seq", "8", "--steps", str(steps),
                      "--eval-batches", str(batches))
        est = run_budget.measured(s, cpu)
        # the peak alone would never have measured it
        assert est.peak_step_s * batches / 3 < run_budget.PROBE_ABOVE_S
        assert calls == ([1] if probed else []), (steps, batches)
    compute = est.dense_flops / 2.0e10 + est.attention_flops / 5.0e9
    assert est.eval_s(7) == pytest.approx(7 * (compute / 3 + 2e-3), rel=1e-12)
    assert est.train_s(7) == pytest.approx(7 * (compute + 6e-3), rel=1e-12)
    fits = int(run_budget.MAX_EVAL_S / est.eval_s(1))  # about 120 s of 2 ms forwards
    with pytest.raises(run_budget.UsageError, match=f"use --eval-batches {fits} or fewer"):
        run_budget.check_budget(s, cpu)
    for batches, refused in ((fits, False), (fits + 1, True)):
        s = _settings("--model", "tiny", "--batch", "1", "--seq", "8", "--steps", "300",
                      "--eval-batches", str(batches))
        with (pytest.raises(run_budget.UsageError) if refused else contextlib.nullcontext()):
            run_budget.check_budget(s, cpu)


def test_the_fixed_cost_of_a_forward_is_measured_without_touching_the_runs_rng() -> None:
    before = torch.get_rng_state()
    fixed = run_budget.forward_fixed_s(_settings("--model", "tiny"))
    assert torch.equal(before, torch.get_rng_state())
    assert 0.0 < fixed < 1.0


def _read_until(stream: object, text: str, timeout_s: float) -> str:
    """What a process wrote to a pipe until `text` appeared (tqdm ends lines with \\r)."""
    deadline, seen = time.monotonic() + timeout_s, ""
    fd = stream.fileno()  # type: ignore[attr-defined]
    while text not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"{text!r} did not appear within {timeout_s} s: {seen[-2000:]!r}"
        chunk = os.read(fd, 4096)
        assert chunk, f"the process ended before {text!r}: {seen[-2000:]!r}"
        seen += chunk.decode(errors="replace")
    return seen


def test_sigterm_during_the_final_evaluation_stops_at_once(tmp_path: Path) -> None:
    """150 evaluation forwards of 4 x 2048 tokens: minutes on one core; the signal ends
    the process within seconds, saying so, with exit code 143."""
    proc = subprocess.Popen([sys.executable, "-m", "superoffload", "train", "--model", "tiny",
                             "--seq", "2048", "--batch", "4", "--steps", "1", "--eval-batches",
                             "150", "--device", "cpu", "--no-report", "--out",
                             str(tmp_path / "run")], cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _read_until(proc.stderr, "eval: ", TIMEOUT_S)  # the evaluation's progress bar
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        stopped_s = time.monotonic() - t0
        err = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        _kill(proc)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert stopped_s < 10.0
    assert "train: SIGTERM received while no training step runs: stopping now" in err
    assert "finishing the current step" not in err
    assert not (tmp_path / "run" / "result.json").exists()


def test_a_refused_evaluation_in_process_names_the_flag(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(run_budget, "probe", lambda s: run_budget.Rates(1.0e10, 1.0e10))
    code = main(["train", "--model", "tiny", "--steps", "2", "--eval-batches", "100000",
                 "--device", "cpu", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(TRAIN + "--eval-batches 100000:")
    assert not (tmp_path / "run").exists()
