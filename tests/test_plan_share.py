"""The planner's word on the machine: a GPU of a shared host gets its share (gpus_per_host),
every profile figure says where it comes from (provenance), and DeepSpeed's ZeRO-Offload row
holds the host memory DeepSpeed pins."""

from __future__ import annotations

import json
import math

import pytest

from superoffload import cli, plan
from superoffload.plan import deepspeed, largest, parallel, storage_presets
from superoffload.plan.hardware import PROVENANCES, HardwareProfile

SXM = plan.profiles.get("h200-sxm")
GH200 = plan.profiles.get("gh200")
LLAMA_70B = plan.ModelShape.from_hf_config("llama-3.1-70b", seq=4096)


def test_a_gpu_of_an_8_gpu_server_gets_an_eighth_of_its_host() -> None:
    assert SXM.gpus_per_host == 8 and SXM.host_memory_bytes == 2048e9
    mine = parallel.rank_profile(SXM, 1)
    assert mine.host_memory_bytes == 256e9 and mine.cpu_cores == 14
    assert mine.host_mem_bw_gbps == SXM.host_mem_bw_gbps / 8
    assert mine.storage_bytes == SXM.storage_bytes / 8  # one of the eight drives
    assert mine.storage_read_gbps == SXM.storage_read_gbps / 8
    assert mine.h2d_gbps == SXM.h2d_gbps  # the link is the GPU's own
    assert mine.gpus_per_host == 1 and parallel.rank_profile(mine, 1) is mine  # once only
    # eight ranks on it split it the same way; a host of its own is the whole host
    assert parallel.rank_profile(SXM, 8).host_memory_bytes == 256e9
    whole = SXM.replace(gpus_per_host=1)
    assert parallel.rank_profile(whole, 1) is whole


def test_llama_70b_no_longer_fits_one_h200_sxm_on_the_whole_servers_memory() -> None:
    # weight-flow needs 12 + 2 + 2 B/param on the host: 1.13 TB, not in 230 GB usable
    assert plan.fit_problems(LLAMA_70B, SXM, "superoffload")
    assert not plan.fit_problems(LLAMA_70B, SXM.replace(gpus_per_host=1), "superoffload")
    # with the storage tier (its share: one of the server's drives) it fits
    assert not plan.fit_problems(LLAMA_70B, SXM, "superoffload", storage=True)


def test_capacity_is_per_gpu_share() -> None:
    flow = next(c for c in largest.COLUMNS if c.label == "SuperOffload weight-flow")
    shared = largest.largest(SXM, flow)
    alone = largest.largest(SXM.replace(gpus_per_host=1), flow)
    assert shared < 20e9 < 100e9 < alone  # 13.9 B against the 101.5 B of the whole host


def test_the_plan_command_shows_the_share(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--hf-config", "llama-3.1-70b", "--profile", "h200-sxm",
                     "--storage", "none"]) == 0
    out = capsys.readouterr().out
    assert "this job: 1/8 of the host" in out and "host 256 GB, 14 cores" in out
    assert "no storage tier" in out
    assert "Nothing fits" in out
    assert cli.main(["plan", "--hf-config", "llama-3.1-70b", "--profile", "h200-sxm",
                     "--storage", "none", "--gpus-per-host", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_share"]["ways"] == 1 and data["host_share"]["host_memory_bytes"] == 2048e9
    assert data["best"] == "superoffload flow"
    assert data["figures"]["gpus_per_host"]["source"].startswith("spec: given on the command")


def test_host_caps_are_on_the_gpus_share() -> None:
    capped = plan.Constraints(host_memory_bytes=100e9, cpu_cores=4).apply(SXM)
    mine = parallel.rank_profile(capped, 1)
    assert mine.host_memory_bytes == pytest.approx(100e9) and mine.cpu_cores == 4


@pytest.mark.parametrize("name", plan.profiles.names())
def test_every_preset_figure_has_a_provenance(name: str) -> None:
    prof = plan.profiles.get(name)
    for field, value, kind in prof.figures():
        assert kind in PROVENANCES, (name, field, value, prof.source(field))


def test_gh200s_link_is_the_published_measurement_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert (GH200.h2d_gbps, GH200.d2h_gbps) == (375.0, 297.0)
    assert GH200.provenance("h2d_gbps") == "measured" and GH200.is_estimate("link_latency_s")
    assert GH200.provenance("device_peak_tflops") == "spec"
    assert cli.main(["plan", "--hf-config", "llama-2-7b", "--profile", "gh200", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    assert figures["h2d_gbps"] == {"value": 375.0, "provenance": "measured",
                                   "source": GH200.source("h2d_gbps")}
    assert "450" in figures["d2h_gbps"]["source"]  # the spec, named beside the measurement


def test_a_profile_file_of_an_older_version_still_loads() -> None:
    old = {**GH200.to_dict(), "sources": [["h2d_gbps", "FACTS.md: NVLink-C2C 450 GB/s"]]}
    prof = HardwareProfile.from_dict(old)
    assert prof.provenance("h2d_gbps") is None and prof.is_estimate("h2d_gbps")


def test_a_storage_tier_is_all_or_nothing() -> None:
    with pytest.raises(ValueError, match="storage tier needs"):
        GH200.replace(storage_write_gbps=0.0)
    none = storage_presets.with_tier(GH200, storage_presets.by_name("none"))
    assert not none.has_storage and none.figures()  # an absent tier asks no provenance
    with pytest.raises(ValueError, match="nvme-gen5x8"):
        storage_presets.by_name("nvme-gen6x4")


def test_deepspeed_pins_powers_of_two() -> None:
    assert deepspeed.pinned_bytes(2**30) == 2**30
    assert deepspeed.pinned_bytes(2**30 + 1) == 2**31
    assert deepspeed.pinned_bytes(0) == 0
    # one partition of n parameters: master and gradient pinned fp32, the bf16 buffer
    # pinned, m and v pageable (DeepSpeedCPUAdam's zeros_like)
    shape = plan.ModelShape(layers=4, hidden=1024, heads=8, vocab=50257, seq=1024)
    res = plan.simulate(shape, GH200, "zero-offload")
    n = shape.params
    largest_param = 50257 * 1024
    p2 = lambda x: 2 ** math.ceil(math.log2(x))  # noqa: E731
    assert res.memory["host"] == 2 * p2(4 * n) + p2(2 * n) + 8 * n + p2(2 * largest_param)


def test_the_zero_offload_row_on_gh200_is_what_deepspeed_pins() -> None:
    col = next(c for c in largest.COLUMNS if c.label == "ZeRO-Offload (ours)")
    params = largest.largest(GH200, col)
    # 2^34 parameters: just below, 2 x 64 GiB + 32 GiB pinned + 8 B/param fit GH200's 432 GB
    # usable; just above, every pinned buffer doubles (the paper: 15 B)
    assert 15e9 <= params <= 2**34
    so = next(c for c in largest.COLUMNS if c.label == "SuperOffload stationary")
    assert largest.largest(GH200, so) / params >= 1.6  # the paper: 25 / 15 = 1.67
