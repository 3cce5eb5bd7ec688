"""`export_hf` of an FSDP2 (DCP) checkpoint, read in one process (docs/export.md, "Sources").

Two gloo ranks train tests/_tiny_models.TinyGPT (tied head) in bf16 with the FSDP2 engine and
save a checkpoint (tests/_fsdp_dp_worker.py ``ckpt``); rank 0 also writes the full fp32
masters at the save (gathered from both ranks' shards). The export, read with the
`safetensors` package, must equal them bit for bit (fp32) or rounded once (bf16); the tied
head is written once, as its embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_support import run_ranks

from superoffload.export import export_hf
from superoffload.runtime.ckpt_files import CheckpointCorrupt

safetensors_torch = pytest.importorskip("safetensors.torch", reason="reads exports back")

WORKER = Path(__file__).with_name("_fsdp_dp_worker.py")
RUN = {"dtype": "bfloat16", "max_grad_norm": 0.5}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("export_dcp")
    for r in run_ranks("ckpt", 2, out, timeout_s=600, args={"run": RUN}, worker=WORKER):
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"
    res = torch.load(out / "ckpt.pt", weights_only=True)
    masters = {k.removesuffix("/master"): v for k, v in res["w_save"].items()
               if k.endswith("/master")}
    return out / "ckpt", masters


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_fsdp2_checkpoint_exports_its_full_masters(saved: Any, tmp_path: Path,
                                                      dtype: str) -> None:
    ckpt, masters = saved
    report = export_hf(ckpt, tmp_path / "out", dtype=dtype)
    assert report.source == f"FSDP2 checkpoint {ckpt}"
    got = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(masters) and "head.weight" not in got  # tied: once
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for name, master in masters.items():
        assert master.dtype == torch.float32 and got[name].dtype == torch_dtype
        assert torch.equal(got[name], master.to(torch_dtype)), name


def test_the_masters_are_not_the_bf16_weights(saved: Any) -> None:
    # the control: the run trained bf16 weights; its masters hold more than bf16 can
    _, masters = saved
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())


def test_an_fsdp2_checkpoint_says_how_to_export_it_and_the_cli_does(
        saved: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from superoffload.cli import main

    ckpt, masters = saved
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["export"].startswith("python -m superoffload export <this folder>")
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--max-shard-size", "4KB"]) == 0
    assert "shards + model.safetensors.index.json" in capsys.readouterr().out
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(masters)


def test_a_shard_from_another_save_is_refused(saved: Any, tmp_path: Path) -> None:
    import shutil

    ckpt, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    data = bytearray((bad / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10
    (bad / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="__1_0.distcp does not match the SHA-256"):
        export_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
