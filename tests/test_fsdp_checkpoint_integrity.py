"""Checkpoints of the FSDP2 engine refuse a flipped byte and a mix of two saves.

Two gloo ranks save one run twice (tests/_fsdp_dp_worker.py ``two_saves``: after 2 and after 4
steps). DCP's files (``.metadata``, ``__<rank>_0.distcp``) carry no checksum of their own,
so the manifest records every file's SHA-256 (distributed/fsdp/checkpoint.py), and the rank
files (RNG states, ``extra``) are also sealed inside (runtime/ckpt_files.py). ``consolidate``
and ``load_checkpoint`` verify them first:

* a mixed save (the second save's manifest and DCP files, the first save's rank 1 shard: a
  save killed midway, or files copied from two places) reads without complaint from DCP,
  only the manifest's SHA-256 can tell; without it the mix loads at iteration 4 with half
  the optimizer state from iteration 2;
* a flipped byte in a DCP shard (which DCP reads silently) or in a rank file is refused,
  naming the file; so is a manifest that records no checksums.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _ckpt_support import flip_tensor_byte
from _dist_support import run_ranks

from superoffload.distributed.fsdp import consolidate
from superoffload.distributed.fsdp.checkpoint import MANIFEST
from superoffload.runtime.ckpt_files import CheckpointCorrupt

WORKER = Path(__file__).with_name("_fsdp_dp_worker.py")
SHARD1 = "__1_0.distcp"
RANK1 = "rank00001-of-00002.pt"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_integrity")
    for r in run_ranks("two_saves", 2, out, timeout_s=300, worker=WORKER):
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"
    return out


def _flip_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def test_each_save_loads_whole(saves: Path) -> None:
    # the control: the files of either save, kept together, consolidate
    for name, iteration in (("a", 2), ("b", 4)):
        cons = consolidate(str(saves / name))
        assert cons.manifest["iteration"] == iteration and cons.extra == {"iteration": iteration}


def test_a_mixed_save_is_refused_naming_the_file(saves: Path, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(saves / "b", mixed)
    shutil.copy2(saves / "a" / SHARD1, mixed / SHARD1)
    with pytest.raises(CheckpointCorrupt, match=f"{SHARD1} does not match the SHA-256"):
        consolidate(str(mixed))


@pytest.mark.parametrize("name", [SHARD1, RANK1, MANIFEST])
def test_a_flipped_byte_is_refused_naming_the_file(saves: Path, tmp_path: Path,
                                                   name: str) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(saves / "b", broken)
    if name == SHARD1:
        _flip_middle(broken / name)
        message = f"{name} does not match the SHA-256"
    elif name == RANK1:
        flip_tensor_byte(broken / name)
        message = f"{name} does not match the SHA-256"
    else:  # a manifest without checksums
        manifest = json.loads((broken / MANIFEST).read_text())
        del manifest["sha256"]
        (broken / MANIFEST).write_text(json.dumps(manifest))
        message = "its manifest records no checksums"
    with pytest.raises(CheckpointCorrupt, match=message):
        consolidate(str(broken))
