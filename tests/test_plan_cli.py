"""`python -m superoffload simulate|tune`: tables, --json, errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from superoffload.cli import main

SHAPE = ["--profile", "gh200", "--layers", "8", "--hidden", "2048", "--heads", "16",
         "--seq", "2048", "--micro-batch", "1"]


def test_simulate_prints_a_table_and_the_ablation(capsys) -> None:
    assert main(["simulate", *SHAPE, "--ablation"]) == 0
    out = capsys.readouterr().out
    for word in ("superoffload", "zero-offload", "gpu", "TFLOPS", "STV (§4.3)", "vs ZeRO"):
        assert word in out


def test_simulate_json(capsys) -> None:
    assert main(["simulate", *SHAPE, "--schedule", "superoffload", "--ratio", "0.8",
                 "--disable", "stv", "--bucket-mb", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (res,) = data["results"]
    assert res["schedule"] == "superoffload" and res["plan"]["ratio"] == 0.8
    assert res["plan"]["speculate"] is False and res["plan"]["bucket_bytes"] == 32 << 20
    assert res["iteration_s"] > 0 and set(res["memory"]) == {"device", "host"}


def test_tune_json_and_out_file(capsys, tmp_path) -> None:
    out = tmp_path / "cfg.json"
    assert main(["tune", *SHAPE, "--fix", "ratio=0.9", "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["ratio"] == 0.9
    assert "- ratio = 0.9: fixed by the constraints." in data["explanation"]
    assert json.loads(out.read_text())["ratio"] == 0.9
    assert main(["tune", *SHAPE]) == 0
    assert "OffloadConfig(" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--profile", "tpu"], "known profiles"),
    (["tune", "--profile", "h100-pcie", "--layers", "96", "--hidden", "12288", "--heads", "96"],
     "host memory"),
    (["tune", *SHAPE, "--fix", "ratio"], "FIELD=VALUE"),
    (["simulate", *SHAPE, "--ratio", "1.5"], "ratio"),
])
def test_errors_exit_2_with_the_reason(capsys, argv, message) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
