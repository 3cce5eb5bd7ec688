"""The largest-model table of docs/planner.md (plan/largest.py, `capacity`): its model family,
DeepSpeed's estimator, and the gh200 row regenerated against the table as printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from superoffload import cli, plan
from superoffload.plan import largest

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
GH200 = plan.profiles.get("gh200")


def test_the_family_is_llama_2_scaled_by_depth() -> None:
    assert largest.llama_by_layers(32, seq=1024, micro_batch=1).params == \
        plan.ModelShape.from_hf_config("llama-2-7b").params == 6_738_415_616
    assert largest.llama_by_layers(40, seq=1024, micro_batch=1).params == \
        plan.ModelShape.from_hf_config("llama-2-13b").params


def test_deepspeeds_estimator_by_hand() -> None:
    shape = largest.llama_by_layers(32, seq=1024, micro_batch=1)
    n = shape.params
    # GPU 2 B/param, CPU 16 B/param x 1.5: fits exactly at those bytes, against all memory
    exact = GH200.replace(device_memory_bytes=2.0 * n, host_memory_bytes=24.0 * n)
    assert largest.deepspeed_estimate_fits(shape, exact)
    assert not largest.deepspeed_estimate_fits(shape, exact.replace(host_memory_bytes=24.0 * n - 1))
    assert not largest.deepspeed_estimate_fits(shape,
                                               exact.replace(device_memory_bytes=2.0 * n - 1))


def _doc_row(profile: str) -> list[str]:
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| {profile} |"):
            return [c.strip() for c in line.strip("|").split("|")][1:]
    raise AssertionError(f"docs/planner.md has no row for {profile}")


def test_the_gh200_row_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["capacity", "--profiles", "gh200", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    printed = [float(re.match(r"[\d.]+", cell).group()) for cell in _doc_row("gh200")]
    assert printed == [round(row[c.label] / 1e9, 1) for c in largest.COLUMNS] + [
        round(row[largest.TIER_TIME], 1)]
    sizes = {c.label: row[c.label] for c in largest.COLUMNS}
    # offloading fits more than the device alone; bf16 moments more than fp32 ones
    assert sizes["plain GPU"] < sizes["SuperOffload stationary"] < sizes[
        "SuperOffload, bf16 moments"]
    assert "(paper 25)" in _doc_row("gh200")[3]
    # the storage tier's target: >= 100 B on one GH200, with its predicted iteration time
    assert sizes[largest.TIER] >= 100e9 and row[largest.TIER_TIME] > 0


def test_the_measured_h200_host_with_four_drives_trains_70b() -> None:
    from superoffload.plan import storage_presets

    host = storage_presets.with_tier(plan.profiles.get("h200-pcie-measured"),
                                     storage_presets.by_name("nvme-gen4x4"))
    tier = next(c for c in largest.COLUMNS if c.label == largest.TIER)
    params, layers = largest.largest_layers(host, tier)
    assert params >= 70e9
    cells = _doc_row("h200-pcie-measured")
    assert float(cells[-2]) == round(params / 1e9, 1)  # capacity's default tier for it
    assert float(cells[-1]) == round(largest.tier_iteration_s(host, layers), 1)
