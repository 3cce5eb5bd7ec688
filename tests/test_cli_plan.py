"""`python -m superoffload plan --hf-config ...` (commands/plan.py): the fit table per system,
memory, predicted time and tuned settings, from a shipped name or a config.json path."""

from __future__ import annotations

import json

import pytest

from superoffload import cli, plan


def run_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_13b_on_h200_pcie_needs_offloading(capsys):
    out = run_json(capsys, "--hf-config", "llama-2-13b", "--profile", "h200-pcie", "--seq",
                   "4096", "--micro-batch", "1")
    assert out["model"]["params"] == 13_015_864_320 and out["model"]["seq"] == 4096
    rows = {r["system"]: r for r in out["rows"]}
    assert list(rows) == ["plain (GPU only)", "ZeRO-Offload", "superoffload stationary",
                          "superoffload flow"]
    plain = rows["plain (GPU only)"]
    # 13B x 16 B/param of mixed-precision Adam state (bf16 weight and gradient, fp32 master,
    # m, v) does not fit 141 GB; the reason says so (7B's 108 GB does: plan.memory)
    assert not plain["fits"] and "device memory" in plain["problems"][0]
    assert rows["ZeRO-Offload"]["fits"] and rows["superoffload stationary"]["fits"]
    # what the table prints is what the planner predicts for the same shape and system
    shape = plan.ModelShape.from_hf_config("llama-2-13b", seq=4096)
    zero = plan.simulate(shape, plan.profiles.get("h200-pcie"), "zero-offload")
    assert rows["ZeRO-Offload"]["iteration_s"] == pytest.approx(zero.iteration_s)
    assert rows["ZeRO-Offload"]["host_bytes"] == pytest.approx(zero.memory["host"])
    flow = rows["superoffload flow"]
    assert flow["config"]["weights"] == "flow" and flow["device_bytes"] < plain["device_bytes"] / 10
    best = rows[out["best"]]
    assert best["iteration_s"] == min(r["iteration_s"] for r in rows.values() if r["fits"])
    assert best["iteration_s"] < rows["ZeRO-Offload"]["iteration_s"]


def test_table_from_a_config_json_path(tmp_path, capsys):
    from superoffload.plan import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config.load_config("gpt2")))
    assert cli.main(["plan", "--hf-config", str(tmp_path / "config.json"), "--profile", "gh200",
                     "--seq", "1024"]) == 0
    text = capsys.readouterr().out
    assert "openai-community/gpt2 (gpt2): 0.12B parameters (124,439,808)" in text
    for label in ("plain (GPU only)", "ZeRO-Offload", "superoffload stationary",
                  "superoffload flow"):
        assert label in text
    assert "Best: " in text  # a 124M model fits everywhere


def test_host_memory_cap_leaves_nothing_that_fits(capsys):
    out = run_json(capsys, "--hf-config", "qwen2.5-14b", "--profile", "h200-pcie",
                   "--host-gb", "8", "--device-gb", "40")
    assert out["best"] is None
    assert all(not r["fits"] and r["problems"] for r in out["rows"])
    assert cli.main(["plan", "--hf-config", "qwen2.5-14b", "--profile", "h200-pcie",
                     "--host-gb", "8", "--device-gb", "40"]) == 0
    assert "Nothing fits this profile" in capsys.readouterr().out


def test_errors_name_the_input(capsys):
    assert cli.main(["plan", "--hf-config", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "llama-2-7b" in err
    assert cli.main(["plan", "--hf-config", "gpt2", "--profile", "no-such-profile"]) == 2
    assert "no-such-profile" in capsys.readouterr().err


def test_listed_in_help():
    assert "plan" in cli.build_parser().format_help()


def test_bad_config_files_name_the_file(tmp_path, capsys):
    # a JSON list gave a raw traceback; a broken file's error did not name it
    listed, broken = tmp_path / "list.json", tmp_path / "broken.json"
    listed.write_text("[1, 2, 3]")
    broken.write_text('{"model_type": "llama",')
    assert cli.main(["plan", "--hf-config", str(listed)]) == 2
    err = capsys.readouterr().err
    assert str(listed) in err and "JSON list, not an object" in err and "Traceback" not in err
    assert cli.main(["plan", "--hf-config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "not valid JSON" in err and "line 1" in err


def test_json_errors_are_json(tmp_path, capsys):
    # with --json, a script reading stdout gets JSON for errors too
    assert cli.main(["plan", "--hf-config", "no-such-model", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert "no-such-model" in out["error"]
    assert cli.main(["plan", "--hf-config", "gpt2", "--profile", "nope", "--json"]) == 2
    assert "nope" in json.loads(capsys.readouterr().out)["error"]


def test_host_bound_models_fit_at_a_lower_ratio(capsys):
    # host memory binds, so the search walks the ratio down from 1
    out = run_json(capsys, "--hf-config", "llama-3-8b", "--profile", "h200-pcie-measured",
                   "--seq", "4096")
    rows = {r["system"]: r for r in out["rows"]}
    stat = rows["superoffload stationary"]
    assert stat["fits"] and stat["config"]["ratio"] < 0.5, stat
    assert stat["host_bytes"] <= 125 * 2**30 * 0.9 and stat["device_bytes"] <= 141e9 * 0.95
    assert out["best"] == "superoffload stationary"
    assert out["calibrated"] is True  # h200-pcie-measured's compute is fitted to a run
    out = run_json(capsys, "--hf-config", "llama-3-8b", "--profile", "h200-pcie", "--seq", "4096")
    assert out["calibrated"] is False and "not calibrated" in out["calibration"]
