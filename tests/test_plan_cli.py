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


def test_facts_table_against_fact_md(capsys) -> None:
    assert main(["simulate", "--facts", "h200"]) == 0
    out = capsys.readouterr().out
    for word in ("132.6", "304.6", "209.5", "156.5", "746.6", "fitted", "next engine"):
        assert word in out, word
    assert main(["simulate", "--facts", "h200", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 7 and all(abs(r["error"]) < 0.25 for r in rows)
    assert sum(r["fitted"] for r in rows) == 1


def test_engine_variant_flags(capsys) -> None:
    base = ["simulate", *SHAPE, "--schedule", "superoffload", "--ratio", "0.9", "--json"]
    assert main(base) == 0
    today = json.loads(capsys.readouterr().out)["results"][0]
    assert main([*base, "--step-order", "edf", "--tail-step", "fused"]) == 0
    nxt = json.loads(capsys.readouterr().out)["results"][0]
    assert today["plan"]["engine"] == {"step_order": "fifo", "tail_step": "unfused",
                                       "d2h_stats_first": True}
    assert nxt["plan"]["engine"]["step_order"] == "edf"
    assert nxt["plan"]["engine"]["tail_step"] == "fused"
    assert nxt["iteration_s"] < today["iteration_s"]
    assert main(["tune", *SHAPE, "--step-order", "edf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prediction"]["plan"]["engine"]["step_order"] == "edf"
