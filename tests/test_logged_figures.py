"""Figures a run logs, checked by value against what they mean.

* The loss the engine records for an iteration (the ``loss`` scalar: dashboard, TensorBoard,
  the report) is the mean of its micro-batches' losses, as a plain loop that divides each
  loss by the accumulation steps reports it (``sum(loss_k / K)``), not their sum.
* A window's TFLOP/s (``telemetry.window.window_values``: the dashboard's status line and
  bins) is the FLOPs of every iteration in it over its wall time: the wall-weighted mean of
  the per-iteration figures (``vocabulary.workload_values``), never one iteration's FLOPs
  over the whole window's time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _engine_ref import HYPER, cpu_config
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.telemetry.vocabulary import workload_values
from superoffload.telemetry.window import WEIGHTS, window_values

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("gas", [1, 3])
def test_the_logged_loss_is_the_mean_over_the_micro_batches(place: str, gas: int) -> None:
    data = batches(2 * gas)
    model = make_model()
    want = []
    with torch.no_grad():  # the same weights the engine's first step starts from
        ref = make_model()
        want.append(sum(float(ref(x, y)) for x, y in data[:gas]) / gas)
    with so.initialize(model, dict(HYPER), cpu_config(grad_accum_steps=gas, grad_accum_on=place,
                                                      ratio=0.5)) as engine:
        seen = []
        for x, y in data:
            loss = model(x, y)
            seen.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        logged = [s.value for s in engine.telemetry.scalars("loss")]
    assert len(logged) == 2
    assert logged[0] == pytest.approx(want[0], rel=1e-6)
    assert logged == pytest.approx([sum(seen[:gas]) / gas, sum(seen[gas:]) / gas], rel=1e-6)


@dataclass(frozen=True)
class It:
    """One iteration's figures (``window.PooledMetrics``): only the time matters here."""

    iteration: int
    wall_s: float
    compute_s: float = 0.0
    cpu_busy_s: float = 0.0
    cpu_step_s: float = 0.0
    cpu_hidden_s: float = 0.0
    exposed_optimizer_s: float = 0.0
    outside_engine_s: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_busy_s: float = 0.0
    h2d_busy_s: float = 0.0
    rollbacks: int = 0
    replays: int = 0


def test_window_tflops_counts_every_iterations_flops() -> None:
    flops = 3e12  # per iteration
    its = [It(k, wall) for k, wall in enumerate((0.5, 1.0, 1.5, 2.0))]  # 5 s in all
    got = window_values(its, flops_per_iteration=flops, tokens=8000.0)
    assert got["tflops"] == pytest.approx(4 * 3.0 / 5.0, rel=1e-12)  # 2.4, not 0.6
    assert got["tokens_per_s"] == pytest.approx(8000.0 / 5.0, rel=1e-12)
    # the wall-weighted mean of the per-iteration figures, as a view's bins pool them
    per = [workload_values(m.wall_s * 1e3, flops_per_iteration=flops)["tflops"] for m in its]
    weights = [m.wall_s for m in its]  # the weight WEIGHTS gives a per-wall rate
    assert weights == [WEIGHTS["d2h_gbps_wall"](m) for m in its]
    pooled = sum(v * w for v, w in zip(per, weights)) / sum(weights)
    assert got["tflops"] == pytest.approx(pooled, rel=1e-12)
    # a window of one iteration is that iteration's figure
    assert window_values(its[1:2], flops_per_iteration=flops)["tflops"] == \
        pytest.approx(per[1], rel=1e-12)
