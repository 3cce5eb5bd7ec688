"""`superoffload train` calibrates the planner after its first iterations:
the summary prints before / after / measured, the run folder keeps the calibrated profile,
and `plan --profile` takes it and says the figures are calibrated."""

from __future__ import annotations

import json
from pathlib import Path

from superoffload import cli, plan
from superoffload.commands.train_calibration import CALIBRATED_PROFILE


def test_train_calibrates_and_plan_reads_the_profile(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", "--steps", "14", "--model", "tiny", "--batch", "2", "--seq",
                     "16", "--eval-batches", "0", "--device", "cpu", "--out", str(out),
                     "--no-report", "--json"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    planner = result["planner"]
    assert planner["iterations"] == [3, 12] and planner["measured_s"] > 0
    assert planner["line"] in printed  # the human summary says it too
    saved = out / CALIBRATED_PROFILE
    prof = plan.HardwareProfile.from_dict(json.loads(saved.read_text()))
    assert prof.name.endswith("-calibrated") and prof.device_op_s > 0
    assert cli.main(["plan", "--hf-config", "gpt2", "--profile", str(saved), "--seq", "64",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibrated"] is True
    short = tmp_path / "short"
    assert cli.main(["train", "--steps", "3", "--model", "tiny", "--batch", "2", "--seq", "16",
                     "--eval-batches", "0", "--device", "cpu", "--out", str(short),
                     "--no-report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["planner"] is None
    assert not (short / CALIBRATED_PROFILE).exists()  # too short to calibrate: nothing fitted
