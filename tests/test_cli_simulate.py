"""`python -m superoffload simulate|tune|capacity` (commands/simulate.py, commands/tune.py):
tables, --json, errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert main(["simulate", *SHAPE, "--system", "superoffload", "--ratio", "0.8",
                 "--disable", "stv", "--bucket-mb", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (res,) = data["results"]
    assert res["system"] == "superoffload" and res["plan"]["ratio"] == 0.8
    assert res["plan"]["speculate"] is False and res["plan"]["bucket_bytes"] == 32 << 20
    assert res["iteration_s"] > 0 and set(res["memory"]) == {"device", "host", "storage"}
    # the system under one key (its old key "schedule" went in 0.2: CHANGELOG.md)
    assert "schedule" not in res and "schedule" not in res["plan"]
    assert res["plan"]["system"] == "superoffload"


@pytest.mark.parametrize(("argv", "says"), [
    (["simulate", *SHAPE, "--schedule", "gpu"], "unrecognized arguments: --schedule"),
    (["simulate", *SHAPE, "--step-order", "edf"], "invalid choice: 'edf'"),
    (["tune", *SHAPE, "--dtype", "bfloat16"], "invalid choice: 'bfloat16'"),
])
def test_the_old_flag_and_value_spellings_are_refused(argv, says, capsys) -> None:
    # --schedule (now --system), --step-order edf (now deadline), --dtype bfloat16 (now bf16)
    # went in 0.2 (CHANGELOG.md): argparse names the flag and the choices, exit code 2
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


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
    for word in ("132.6", "304.6", "209.5", "156.5", "746.6", "fitted", "engine now",
                 "a prediction, not yet measured", "the H200 speed targets", ">= 0.65x  missed"):
        assert word in out, word
    assert main(["simulate", "--facts", "h200", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 7 and all(abs(r["error"]) < 0.25 for r in rows)
    assert sum(r["fitted"] for r in rows) == 1
    # the engine now predicts our rows faster than the engine they were measured with
    ours = [r for r in rows if r["schedule"].startswith("ours")]  # the table's row label
    assert ours and all(r["predicted_engine_now_ms"] < r["predicted_ms"] for r in ours)


def test_engine_variant_flags(capsys) -> None:
    base = ["simulate", *SHAPE, "--system", "superoffload", "--ratio", "0.5", "--json"]

    def run(*flags: str) -> dict:
        assert main([*base, *flags]) == 0
        return json.loads(capsys.readouterr().out)["results"][0]

    now, fifo, unfused = run(), run("--step-order", "fifo"), run("--tail-step", "unfused")
    # the default is the engine that runs (plan.schedule.ENGINE)
    assert now["plan"]["engine"] == {"step_order": "deadline", "tail_step": "fused",
                                     "d2h_stats_first": False, "merge_small_buckets": True,
                                     "buckets_per_unit": False}
    assert now == run("--step-order", "deadline")
    # --step-order is OffloadConfig.step_order; --tail-step a what-if of the same engine
    assert fifo["plan"]["engine"]["step_order"] == "fifo"
    assert fifo["plan"]["engine"]["tail_step"] == "fused"
    assert unfused["plan"]["engine"] == {**now["plan"]["engine"], "tail_step": "unfused"}
    busy = "device_optimizer"  # here the CPU lane, not the tail step, bounds the iteration
    assert unfused["lanes"][busy]["busy_s"] > 3 * now["lanes"][busy]["busy_s"]  # 118 vs 28 B
    assert fifo["iteration_s"] > now["iteration_s"] * 1.03
    # tune: the fixed step order is in the config it writes, and its prediction uses it
    assert main(["tune", *SHAPE, "--step-order", "fifo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["step_order"] == "fifo"
    assert data["prediction"]["plan"]["engine"]["step_order"] == "fifo"
    assert "- step_order = 'fifo': fixed by the constraints." in data["explanation"]


def test_tune_out_unwritable_is_one_argparse_error(capsys, tmp_path, monkeypatch) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--out", str(tmp_path / "missing" / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out" in err and "does not exist" in err
    assert "Traceback" not in err
    # the folder checked at parse time can still refuse the write: one line, exit 2
    def refuse(self: Path, *args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    assert main(["tune", *SHAPE, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "Permission denied" in err[0]


def test_tune_bf16_moments_flag(capsys) -> None:
    # a 0.5B model on an H100 PCIe capped at 6 GB: most state offloaded, the host bus bound
    pcie = ["--profile", "h100-pcie", "--layers", "8", "--hidden", "2048", "--heads", "16",
            "--seq", "512", "--micro-batch", "1", "--device-gb", "6", "--json"]
    assert main(["tune", *pcie]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["config"]["optimizer_state_dtype"] == "fp32"
    assert "--allow-bf16-moments" in plain["explanation"]  # it would pay: said, not done
    assert main(["tune", *pcie, "--allow-bf16-moments"]) == 0
    allowed = json.loads(capsys.readouterr().out)
    assert allowed["config"]["optimizer_state_dtype"] == "bf16"
    assert "CHANGES THE NUMERICS" in allowed["explanation"]
    assert allowed["prediction"]["iteration_s"] < plain["prediction"]["iteration_s"] * 0.98


def test_json_errors_are_json(capsys) -> None:
    assert main(["tune", "--profile", "h100-pcie", "--layers", "96", "--hidden", "12288",
                 "--heads", "96", "--json"]) == 2
    assert "host memory" in json.loads(capsys.readouterr().out)["error"]
    assert main(["simulate", "--profile", "tpu", "--json"]) == 2
    assert "known profiles" in json.loads(capsys.readouterr().out)["error"]
