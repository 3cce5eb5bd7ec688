"""One rank of tests/test_fsdp_failures.py (via _dist_support): a rank killed at a chosen
point, and BatchNorm buffers across a DCP checkpoint.

    python tests/_fsdp_kill_worker.py SCENARIO OUT_DIR ARGS_JSON

Scenarios:
  killed   after one iteration, rank 1 SIGKILLs itself at args["at"] (before the forward,
           inside backward from a gradient hook, inside the engine's step; args["slowly"]:
           its connections close first); rank 0 goes on and writes the error it got
           (killed_rank0.json)
  buffers  a model with BatchNorm, FSDP2 over 2 ranks, each rank on its own data (so each
           rank's running statistics differ); save a DCP checkpoint, load it into a fresh
           model and engine; each rank writes its buffers before and after (buffers_rankR.pt)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _engine_ref import HYPER
from _fsdp_dp_worker import build, global_data, local

from superoffload.config import OffloadConfig
from superoffload.distributed import init_distributed
from superoffload.distributed.fsdp import FsdpOffloadEngine


def _die(slowly: bool) -> None:
    """SIGKILL this process, as the OOM killer does: no cleanup, no goodbye. ``slowly``: its
    connections close half a second before it exits (a kill's teardown, drawn out so the
    survivor always hears of the closed connections first, as it sometimes does anyway)."""
    if slowly:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    sock = socket.socket(fileno=int(fd))
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.detach()  # the descriptor stays open: the process is not gone yet
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_killed(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    data = global_data(3)
    model, engine = build({"max_grad_norm": 0.5})
    at, slowly = args["at"], bool(args.get("slowly"))

    def step(k: int) -> None:
        x, y = data[k]
        if k == 1 and rank == 1 and at == "forward":
            _die(slowly)
        loss = model(local(x, rank, world), local(y, rank, world))
        if k == 1 and rank == 1 and at == "backward":
            loss.register_hook(lambda g: _die(slowly))
        engine.backward(loss)
        if k == 1 and rank == 1 and at == "step":
            _die(slowly)
        engine.step()
        engine.zero_grad()

    step(0)
    t0 = time.monotonic()
    record: dict[str, Any]
    try:
        for k in (1, 2):
            step(k)
        engine.synchronize()
        record = {"error": None}
    except BaseException as exc:  # the test reads what the survivor was told
        record = {"error": str(exc), "type": type(exc).__name__}
    record["seconds"] = time.monotonic() - t0
    (out / f"killed_rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip teardown with a dead peer


class NormNet(torch.nn.Module):
    """Two linear layers with BatchNorm between them (running mean and variance buffers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x)))).square().mean()


def _norm_engine() -> tuple[NormNet, FsdpOffloadEngine]:
    model = NormNet()
    config = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.5, telemetry=False)
    return model, FsdpOffloadEngine(model, {**HYPER}, config)


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def scenario_buffers(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    model, engine = _norm_engine()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own data
    for _ in range(3):
        x = torch.randn(6, 8, generator=gen) * (1 + rank)
        engine.backward(model(x))
        engine.step()
        engine.zero_grad()
    saved = _buffers(model)
    engine.save_checkpoint(str(out / "ckpt"))
    engine.close()
    fresh, engine = _norm_engine()
    engine.load_checkpoint(str(out / "ckpt"))
    torch.save({"saved": saved, "loaded": _buffers(fresh)}, out / f"buffers_rank{rank}.pt")
    engine.close()


SCENARIOS = {"killed": scenario_killed, "buffers": scenario_buffers}


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    info = init_distributed(backend="gloo", timeout_s=float(args.get("timeout_s", 60)))
    SCENARIOS[scenario](out, info.rank, info.world_size, args)


if __name__ == "__main__":
    main()
