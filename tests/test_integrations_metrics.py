"""What the Trainer and Lightning integrations log equals the telemetry's own figure.

A logged `superoffload/...` value is the engine's telemetry pooled over the iterations since
the previous log (`integrations/bridge.py`, `telemetry/window.py`). The old tests asserted
only that the keys were there and positive, so a link rate computed from milliseconds as if
they were seconds (1000x low) passed them. Here every log's window (the count it reports,
`superoffload/window_iterations`, tiling the run's iterations in order) is rebuilt from the
engine's whole timeline and each figure the window defines (`telemetry.window.WINDOW_NAMES`:
link rates, iteration time, shares, counts) is compared with `window_values` of those
iterations. Tokens per second depend on the batches the loop counted, not on the timeline,
and are checked against the tokens trained.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from superoffload.integrations.bridge import METRIC_PREFIX
from superoffload.telemetry.metrics import iteration_metrics
from superoffload.telemetry.window import WINDOW_NAMES, window_values

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

LINK = ("d2h_gbps_busy", "h2d_gbps_busy", "d2h_gbps_wall", "h2d_gbps_wall")


def assert_logs_are_the_telemetry(logs: list[dict[str, float]], spans: list[Any],
                                  counters: dict[str, Any]) -> None:
    """`counters`: the engine's `stats.as_dict()`; names logged from them are the engine's
    running totals (docs/integrations.md), not window figures: each may only grow, up to
    the final total."""
    rows = [r for r in logs if METRIC_PREFIX + "window_iterations" in r]
    assert rows, "no log carried the engine's metrics"
    ms = iteration_metrics(spans)
    first = 0
    compared: set[str] = set()
    for row in rows:
        n = int(row[METRIC_PREFIX + "window_iterations"])
        window = ms[first:first + n]
        first += n
        assert len(window) == n, f"the logs cover {first} iterations, the timeline {len(ms)}"
        want = window_values(window)
        for name in WINDOW_NAMES:
            key = METRIC_PREFIX + name
            if name in counters:
                continue
            if not math.isfinite(want[name]):
                assert key not in row, (name, row.get(key))  # undefined: left out
                continue
            assert row[key] == pytest.approx(want[name], rel=1e-9, abs=1e-12), name
            compared.add(name)
    assert set(LINK) <= compared  # the link rates were there to compare, in every direction
    for name in counters:
        values = [r[METRIC_PREFIX + name] for r in rows if METRIC_PREFIX + name in r]
        assert values == sorted(values) and all(v <= counters[name] for v in values), name
    busy = METRIC_PREFIX + "d2h_gbps_busy"
    assert all(r[busy] > 0 for r in rows if busy in r)


def test_trainer_logs_the_telemetrys_own_figures(tmp_path: Any) -> None:
    pytest.importorskip("transformers", reason="needs the 'hf' extra (transformers)")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from test_integrations_hf import STEPS, train_offload
    from transformers import TrainerCallback

    seen: list[dict[str, float]] = []

    class Capture(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    trainer = train_offload(tmp_path, callbacks=[Capture()], eval_strategy="no", logging_steps=2)
    try:
        assert len([r for r in seen if "loss" in r]) == STEPS // 2
        assert_logs_are_the_telemetry(seen, trainer.engine.telemetry.spans(),
                                      trainer.engine.stats.as_dict())
    finally:
        trainer.close()


def test_lightning_logs_the_telemetrys_own_figures() -> None:
    pytest.importorskip("lightning", reason="needs the 'lightning' extra")
    import lightning.pytorch as pl
    from _tiny_models import batches
    from test_integrations_lightning import ENGINE, GAS, STEPS, Capture, Module, fit

    from superoffload.integrations.lightning import SuperOffloadStrategy

    class Timeline(pl.Callback):
        """The engine's whole timeline at the end of fit (teardown closes the engine)."""

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.spans = trainer.strategy.engine.telemetry.spans()
            self.counters = trainer.strategy.engine.stats.as_dict()

    logger, timeline = Capture(), Timeline()
    fit(Module(), batches(STEPS * GAS), strategy=SuperOffloadStrategy(ENGINE), logger=logger,
        callbacks=[timeline])
    assert_logs_are_the_telemetry(logger.metrics, timeline.spans, timeline.counters)


def test_the_check_catches_a_rate_off_by_a_thousand() -> None:
    """The comparison fails on a link rate computed from milliseconds as if seconds."""
    import superoffload as so

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    config = so.OffloadConfig(device="cpu", bucket_bytes=4096, cpu_threads=1, ratio=0.5)
    from superoffload.integrations.bridge import EngineMetrics

    with so.initialize(model, {"lr": 1e-3}, config) as engine:
        metrics, logs = EngineMetrics(engine), []
        for k in range(8):
            engine.backward(model(torch.randn(4, 32)).square().mean())
            engine.step()
            engine.zero_grad()
            if k % 2:
                logs.append(metrics.collect())
        engine.synchronize()
        spans, counters = engine.telemetry.spans(), engine.stats.as_dict()
    assert_logs_are_the_telemetry(logs, spans, counters)
    bad = [{k: v / 1e3 if k.endswith("d2h_gbps_busy") else v for k, v in r.items()} for r in logs]
    with pytest.raises(AssertionError, match="d2h_gbps_busy"):
        assert_logs_are_the_telemetry(bad, spans, counters)
