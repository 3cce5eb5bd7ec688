"""One rank of the one-engine tests at world size 2 (run by tests/test_one_engine_dp.py).

    python tests/_one_engine_worker.py SCENARIO OUT_DIR ARGS_JSON

Scenarios:
  schedule  build ZeroOffloadEngine for each config in args["configs"] and write the schedule
            it runs (effective ratio, bucket table, threads) per config, rank 0 only
  sparse    a layer only rank 0's loss uses and one no rank uses: train 3 steps, write the
            full masters (rank 0)
  stall     rank 1 stops itself (SIGSTOP); rank 0 writes how long it took to fail and why
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from _tiny_models import batches, make_model

from superoffload.config import OffloadConfig
from superoffload.distributed import init_distributed, shutdown
from superoffload.distributed.zero import ZeroOffloadEngine
from superoffload.runtime.errors import EngineError

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


class Sparse(torch.nn.Module):
    """``rare`` is used only when asked (rank 0), ``idle`` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(8, 8)
        self.rare = torch.nn.Linear(8, 8)
        self.idle = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.idle.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = self.used(x)
        if use_rare:
            h = h + self.rare(x)
        return h.square().mean()


def sparse_data(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


def scenario_schedule(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    rows = {}
    for name, fields in args["configs"].items():
        model = make_model(0)
        with ZeroOffloadEngine(model, HYPER, OffloadConfig(**fields)) as engine:
            s = engine.schedule
            rows[name] = {"ratio": s.ratio, "table": [list(map(_plain, r))
                                                      for r in s.bucket_table()],
                          "threads": s.threads, "host_numel": s.host_numel,
                          "dp": s.dp, "weights": s.weights}
    if rank == 0:
        (out / "schedule.json").write_text(json.dumps(rows))


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def scenario_sparse(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    model = Sparse()
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=args["ratio"], cpu_threads=1,
                        telemetry=False, speculation="on")
    with ZeroOffloadEngine(model, HYPER, cfg) as engine:
        for x in sparse_data(3):
            half = x[rank * 2:(rank + 1) * 2]
            engine.backward(model(half, use_rare=rank == 0))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
        rollbacks = engine.stats.rollbacks
    if rank == 0:
        torch.save({"masters": masters, "rollbacks": rollbacks}, out / "sparse.pt")


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=float(args.get("timeout_s", 60)))
    {"schedule": scenario_schedule, "sparse": scenario_sparse, "stall": scenario_stall,
     "ckptfail": scenario_ckptfail}[scenario](
        out, info.rank, info.world_size, args)
    shutdown()



def scenario_stall(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 1 stops itself (SIGSTOP) in iteration 1; rank 0 must fail within the timeout,
    naming the stopped rank and the collective, and close() must return promptly."""
    import signal
    import time

    model = make_model(0)
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.8, cpu_threads=1,
                        telemetry=False, watchdog_s=600.0)
    engine = ZeroOffloadEngine(model, HYPER, cfg)
    data = batches(3, seed=1, batch=2, seq=12)
    x, y = data[0]
    engine.backward(model(x, y))
    engine.step()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    record: dict[str, Any] = {}
    try:
        for x, y in data[1:]:
            engine.backward(model(x, y))
            engine.step()
        engine.synchronize()
        record["error"] = None
    except Exception as exc:
        record.update(error=str(exc), type=type(exc).__name__,
                      engine_error=isinstance(exc, EngineError))
    record["seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        engine.close()
    except Exception as exc:
        record["close_error"] = repr(exc)
    record["close_seconds"] = time.monotonic() - t1
    (out / "stall_rank0.json").write_text(json.dumps(record))
    os._exit(0)  # skip the process-group teardown with a stopped peer



def scenario_ckptfail(out: Path, rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 1 cannot write its checkpoint file: every rank must raise at once (none waits)."""
    import time

    from superoffload.distributed.zero import checkpoint

    model = make_model(0)
    cfg = OffloadConfig(device="cpu", bucket_bytes=4096, ratio=0.8, cpu_threads=1,
                        telemetry=False)
    with ZeroOffloadEngine(model, HYPER, cfg) as engine:
        x, y = batches(1, seed=1, batch=2, seq=12)[0]
        engine.backward(model(x, y))
        engine.step()
        if rank == 1:
            def full_disk(payload: Any, final: str) -> Any:
                raise OSError(28, "No space left on device")
            checkpoint.write_atomic = full_disk  # type: ignore[assignment]
        t0 = time.monotonic()
        try:
            engine.save_checkpoint(str(out / "ckpt"))
            record: dict[str, Any] = {"error": None}
        except OSError as exc:
            record = {"error": str(exc)}
        record["seconds"] = time.monotonic() - t0
        record["manifest"] = (out / "ckpt" / "manifest.json").exists()
    (out / f"ckptfail_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
