"""Sharded (ZeRO) checkpoints refuse a flipped byte and a mix of two saves (issue 22).

Two gloo ranks save one run twice (tests/_zero_ckpt_worker.py: after 2 and after 4 steps).
Each rank file is sealed with a checksum of its contents and the manifest records every
file's SHA-256 (runtime/ckpt_files.py, distributed/zero/checkpoint.py). Loading starts with
``consolidate`` (``zero.checkpoint.load`` calls it first), so these checks run it directly:

* a mixed save (the second save's manifest and rank 0, the first save's rank 1: a save
  killed midway, or files copied from two places) is whole file by file and tiles every
  parameter, so only the manifest's SHA-256 can tell; without it the mix loads at
  iteration 4 with half the optimizer state from iteration 2;
* a flipped byte in a tensor (which ``torch.load`` reads silently) is refused by the
  manifest's SHA-256 and, with a manifest that records none (written before checksums
  existed), by the seal inside the file.

One launch of 2 processes, ~10 s on an idle 2-core machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _ckpt_support import flip_tensor_byte
from _dist_support import run_ranks

from superoffload.distributed.zero.checkpoint import MANIFEST, consolidate
from superoffload.runtime.ckpt_files import CheckpointCorrupt

WORKER = Path(__file__).with_name("_zero_ckpt_worker.py")
RANK1 = "rank00001-of-00002.pt"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero_integrity")
    for r in run_ranks("two_saves", 2, out, timeout_s=120, worker=WORKER):
        assert r.returncode == 0, f"rank {r.rank}: exit {r.returncode}\n{r.log[-4000:]}"
    return out


def test_each_save_loads_whole(saves: Path) -> None:
    # the control: the files of either save, kept together, consolidate
    for name, iteration in (("a", 2), ("b", 4)):
        cons = consolidate(str(saves / name))
        assert cons.manifest["iteration"] == iteration and cons.extra == {"iteration": iteration}


def test_a_mixed_save_is_refused_naming_the_file(saves: Path, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(saves / "b", mixed)
    shutil.copy2(saves / "a" / RANK1, mixed / RANK1)
    with pytest.raises(CheckpointCorrupt, match=f"{RANK1} does not match the SHA-256"):
        consolidate(str(mixed))


@pytest.mark.parametrize("manifest_sha", [True, False], ids=["manifest_sha256", "seal_only"])
def test_a_flipped_byte_is_refused_naming_the_file(saves: Path, tmp_path: Path,
                                                   manifest_sha: bool) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(saves / "b", broken)
    flip_tensor_byte(broken / RANK1)
    if manifest_sha:
        message = f"{RANK1} does not match the SHA-256"
    else:  # a manifest without checksums: the seal inside the file is the only guard
        manifest = json.loads((broken / MANIFEST).read_text())
        del manifest["sha256"]
        (broken / MANIFEST).write_text(json.dumps(manifest))
        message = f"{RANK1} is corrupt: its contents do not match the checksum sealed"
    with pytest.raises(CheckpointCorrupt, match=message):
        consolidate(str(broken))
