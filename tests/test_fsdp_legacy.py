"""A checkpoint of the former ZeRO engine is converted by the FSDP2 engine on load.

tests/fixtures/zero_checkpoint/ holds one, written on 2 ranks by that engine before it was
removed (README.md there: how; reference.pt: the state it saved and the masters 2 steps
later). Here, in one process (a one-rank gloo group): ``load_checkpoint`` reads it
(distributed/fsdp/legacy.py), every master and moment bit-identical to what was saved, the
iteration, LR schedule and ``extra`` restored; 2 more steps on the whole batch match the
2-rank ZeRO run within 1e-6 (the same maths, another sum order); the next save writes the
DCP format, which ``consolidate`` reads back.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _engine_ref import HYPER, groups_for, max_diff
from _tiny_models import batches, make_model

from superoffload.config import OffloadConfig

FIXTURE = Path(__file__).with_name("fixtures") / "zero_checkpoint"
KW = {"dim": 8, "hidden": 8, "n_blocks": 2}
CONFIG = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.8, speculation="on",
                       rollback="snapshot", max_grad_norm=0.5, telemetry=False, watchdog_s=60.0)


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    from superoffload.distributed import init_distributed, shutdown

    init_distributed(backend="gloo", env={}, timeout_s=30)
    try:
        yield
    finally:
        shutdown()


def test_a_zero_checkpoint_is_converted_exactly(world: None, tmp_path: Path) -> None:
    from superoffload.distributed.fsdp import FsdpOffloadEngine, consolidate

    ref = torch.load(FIXTURE / "reference.pt", weights_only=True)
    ckpt = tmp_path / "zero"
    shutil.copytree(FIXTURE / "checkpoint", ckpt)
    model = make_model(3, **KW)  # other weights: the load must overwrite them
    with FsdpOffloadEngine(model, groups_for(model, True, HYPER), CONFIG) as engine:
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1.0 + s))
        extra = engine.load_checkpoint(str(ckpt), lr_scheduler=sched)
        assert extra == {"note": "zero, after 2 steps"} and engine.iteration == 2
        loaded = {f"{engine.state.names[i]}/{k}": getattr(s, k).full_tensor()
                  for i, s in engine.export_states().items()
                  for k in ("master", "exp_avg", "exp_avg_sq")}
        assert max_diff(ref["saved"], loaded) == 0.0
        data = batches(4, seed=1, batch=4, seq=12)
        for x, y in data[2:]:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            sched.step()
        assert max_diff(ref["after_4"], engine.master_weights()) < 1e-6
        assert sched.get_last_lr() == pytest.approx(ref["lr"])
        engine.save_checkpoint(str(tmp_path / "dcp"))
    cons = consolidate(str(tmp_path / "dcp"))
    assert cons.manifest["format"] == "superoffload-fsdp/1" and cons.manifest["iteration"] == 4
    assert max_diff(ref["after_4"], {n: s.master for n, s in cons.states.items()}) < 1e-6


def test_consolidate_reads_the_former_format(tmp_path: Path) -> None:
    from superoffload.distributed.fsdp import consolidate

    ref = torch.load(FIXTURE / "reference.pt", weights_only=True)
    cons = consolidate(str(FIXTURE / "checkpoint"))
    got = {f"{n}/{k}": getattr(s, k) for n, s in cons.states.items()
           for k in ("master", "exp_avg", "exp_avg_sq")}
    assert max_diff(ref["saved"], got) == 0.0 and len(cons.rng) == 2
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURE / "checkpoint", broken)
    (broken / "rank00001-of-00002.pt").unlink()
    with pytest.raises(FileNotFoundError, match="rank00001-of-00002.pt"):
        consolidate(str(broken))
