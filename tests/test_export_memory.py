"""An export's memory is bounded by one tensor, not by the checkpoint (docs/export.md,
"Memory").

In a fresh process, an ``engine.pt`` of 32 parameters of 1 MiB each (with moments and the
model's bf16 copy: a ~117 MB file, sealed, no meta.json) is exported while the process's
anonymous resident memory (``RssAnon``: what the process allocated, not the file pages a
memory map shares with the page cache) is sampled at every tensor the writer asks for.
Loading the file unmapped adds its whole size (measured 119 MB); reading it mapped, one
tensor at a time, adds about one tensor (measured 0.4 MB). The bound, 48 MB, lies between.
Counts bytes, not time: the machine's load does not change it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys, torch
from superoffload.export import export_hf
from superoffload.export.detect import open_source
from superoffload.runtime import engine_checkpoint as single
from superoffload.runtime.ckpt_files import write_atomic

folder, out = sys.argv[1], sys.argv[2]
n, numel = 32, 1 << 18  # 32 parameters of 1 MiB (fp32)
g = torch.Generator().manual_seed(0)
state, model = {}, {}
for i in range(n):
    master = torch.randn(numel, generator=g)
    state[f"p{i}"] = {"master": master, "exp_avg": torch.randn(numel, generator=g),
                      "exp_avg_sq": torch.rand(numel, generator=g), "step": 3}
    model[f"p{i}"] = master.to(torch.bfloat16)
signature = [[f"p{i}", [numel], "bfloat16", True] for i in range(n)]
import os
os.makedirs(folder)
write_atomic({"format": single.ENGINE_FORMAT, "state": state, "model": model,
              "signature": signature}, os.path.join(folder, "engine.pt"))
del state, model, master

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon")

import gc; gc.collect()
base = rss_anon()
samples = []

class Sampled:
    def __init__(self, inner):
        self.inner = inner
        self.what, self.stem, self.single_file = inner.what, inner.stem, inner.single_file
        samples.append(rss_anon())  # after opening (and verifying) the file
    def entries(self): return self.inner.entries()
    def read_master(self, name):
        samples.append(rss_anon())
        return self.inner.read_master(name)
    def read_other(self, name):
        samples.append(rss_anon())
        return self.inner.read_other(name)
    def extras(self): return self.inner.extras()
    def close(self): self.inner.close()

report = export_hf(Sampled(open_source(folder)), out, max_shard_bytes=8 << 20)
print(json.dumps({"added": max(samples) - base, "reads": len(samples) - 1,
                  "file": os.path.getsize(os.path.join(folder, "engine.pt")),
                  "files": len(report.files)}))
"""


def test_exporting_an_engine_checkpoint_holds_one_tensor_not_the_file(tmp_path: Path) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc/self/status (RssAnon)")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["reads"] == 32 and got["files"] == 4
    assert got["file"] > 110e6  # the whole file would be at least this much
    # measured 0.4 MB; 119 MB when the file is loaded unmapped (torch.load without mmap)
    assert got["added"] < 48e6, got
