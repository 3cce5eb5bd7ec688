"""The storage tier's configuration surface: DeepSpeed's ``offload_optimizer.device: "nvme"``
keys and ``aio`` block (their meanings, or refused naming the difference), the command line
(``train --storage-path --host-memory-budget``), its run budget, and what the run reports
(result.json's ``storage`` figures, the storage lane in the trace and the report)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import superoffload as so
from superoffload.commands import argtypes
from superoffload.commands.run_budget import estimate
from superoffload.commands.train_args import RunSettings
from superoffload.config import ConfigError
from superoffload.ds_config import AIO_FIELDS, AIO_STATES_PER_BUFFER
from superoffload.ds_keys import DeepSpeedNotice
from superoffload.telemetry.events import (
    KIND_CPU_STEP,
    KIND_FORWARD,
    KIND_TIER_READ,
    KIND_TIER_WRITE,
    LANE_COMPUTE,
    LANE_CPU,
    LANE_STORAGE,
    Span,
)
from superoffload.telemetry.storage_io import storage_io

NVME = {"zero_optimization": {"stage": 2, "offload_optimizer": {
    "device": "nvme", "nvme_path": "/nvme/so", "buffer_count": 8}}}


def convert(ds: dict[str, Any]) -> so.OffloadConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return so.from_deepspeed(ds)[0]


def test_nvme_offload_takes_deepspeeds_keys_with_their_meanings() -> None:
    aio = {"block_size": 262144, "queue_depth": 16, "thread_count": 2}
    cfg = convert({**NVME, "aio": aio})
    assert cfg.storage_path == "/nvme/so"
    assert cfg.storage_buffer_count == 8 // AIO_STATES_PER_BUFFER
    for key, field in AIO_FIELDS.items():  # every aio key the conversion reads
        if key in aio:
            assert getattr(cfg, field) == aio[key], key
    assert cfg.ratio == 1.0  # DeepSpeed's default ratio: every bucket offloaded
    assert convert({**NVME, "aio": {"intra_op_parallelism": 3}}).storage_threads == 3


def test_deepspeed_io_keys_that_change_nothing_are_listed_once() -> None:
    with pytest.warns(DeepSpeedNotice, match="aio.single_submit.*aio.overlap_events"):
        so.from_deepspeed({**NVME, "aio": {"single_submit": True, "overlap_events": False}})


@pytest.mark.parametrize(("ds", "words"), [
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "needs .*nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                  "buffer_count": 6}}}, "multiple of 4"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_path": "/x"}}},
     "applies to device 'nvme' only"),
    ({**NVME, "aio": {"use_gds": True}}, "GPUDirect"),
    ({**NVME, "aio": {"thread_count": 2, "intra_op_parallelism": 3}}, "one setting"),
    ({**NVME, "aio": {"queue_depth": 0}}, "aio.queue_depth=0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, "'cpu', 'nvme'"),
])
def test_what_differs_from_deepspeed_is_refused_naming_the_key(ds: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        convert(ds)


@pytest.mark.parametrize(("text", "value"), [
    ("1500000", 1_500_000), ("500MB", 500_000_000), ("8GiB", 8 << 30), ("1.5tb", 1.5e12),
    ("64 KiB", 64 << 10)])
def test_byte_sizes_read_decimal_and_binary_units(text: str, value: float) -> None:
    assert argtypes.byte_size(text) == int(value)


@pytest.mark.parametrize("text", ["8GB/s", "-1GB", "0.1", "lots"])
def test_a_byte_size_that_is_no_size_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.byte_size(text)


def _settings(**kw: Any) -> RunSettings:
    base = dict(model="small", hf=False, batch=4, seq=64, lr=1e-3, warmup=0, weight_decay=0.1,
                max_grad_norm=1.0, seed=0, steps=1, dtype="bf16", dp=1, sp=1, preset="auto",
                ratio=None, bucket_mb=None, speculation=None, weights=None,
                checkpointing=False, eval_batches=0)
    return RunSettings(**{**base, **kw})


def test_the_run_budget_counts_only_what_the_tier_leaves_in_memory() -> None:
    cpu = torch.device("cpu")
    plain = estimate(_settings(), cpu)
    tier = estimate(_settings(storage_path="/x", host_memory_budget=10_000), cpu)
    params = (plain.memory_bytes - plain.activation_bytes) / 16  # 16 B/param in memory
    # on the tier: weights and gradients in bf16 (2 + 2 B/param) and the budget
    assert tier.memory_bytes - tier.activation_bytes == pytest.approx(4 * params + 10_000)


def _spans() -> list[Span]:
    return [Span(LANE_COMPUTE, KIND_FORWARD, 0.0, 1.0, 0),
            Span(LANE_STORAGE, KIND_TIER_READ, 0.5, 1.5, 0, 0, 2_000_000_000),
            Span(LANE_STORAGE, KIND_TIER_READ, 1.0, 2.0, 0, 1, 1_000_000_000),
            Span(LANE_CPU, KIND_CPU_STEP, 2.5, 3.0, 0),
            Span(LANE_STORAGE, KIND_TIER_WRITE, 2.0, 4.0, 0, 0, 4_000_000_000),
            Span(LANE_COMPUTE, KIND_FORWARD, 10.0, 11.0, 1)]


def test_storage_figures_come_from_the_storage_spans() -> None:
    io = storage_io(_spans())
    assert io is not None and io.iterations == 2
    assert io.read_gbps == pytest.approx(3.0 / 1.5)  # 3 GB over the union [0.5, 2.0]
    assert io.write_gbps == pytest.approx(2.0)
    assert io.read_bytes_per_iteration == pytest.approx(1.5e9)
    assert io.write_bytes_per_iteration == pytest.approx(2e9)
    # storage busy [0.5, 4.0]; computing or stepping [0, 1] and [2.5, 3]: alone 2.5 s
    assert io.exposed_s_per_iteration == pytest.approx(2.5 / 2)
    assert storage_io([s for s in _spans() if s.lane != LANE_STORAGE]) is None


def test_train_with_the_tier_reports_its_io_in_the_summary_json_and_trace(tmp_path: Path) -> None:
    out, tier = tmp_path / "run", tmp_path / "tier"
    proc = subprocess.run(
        [sys.executable, "-m", "superoffload", "train", "--steps", "3", "--model", "tiny",
         "--batch", "2", "--seq", "32", "--eval-batches", "0", "--device", "cpu",
         "--ratio", "1", "--storage-path", str(tier), "--storage-buffers", "1",
         "--trace", "--out", str(out), "--json"],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    io = result["storage"]
    assert io["read_bytes_per_iteration"] > 0 and io["write_bytes_per_iteration"] > 0
    assert io["read_gbps"] > 0 and io["write_gbps"] > 0
    assert "storage tier: read" in proc.stdout
    trace = json.loads(Path(result["trace"]).read_text())
    names = {e.get("args", {}).get("name") for e in trace["traceEvents"]
             if e.get("ph") == "M"}
    assert any(n and "storage" in n.lower() for n in names), names
    assert "storage" in Path(result["report"]).read_text().lower()
    assert not any(tier.iterdir())  # the run closed its engine: the file is gone
