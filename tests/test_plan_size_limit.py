"""A shape whose simulation would not fit is refused before anything is allocated,
by the API and by the command line, with the sizes in the message."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from superoffload import plan
from superoffload.cli import main
from superoffload.config import OffloadConfig
from superoffload.plan.size_limit import (
    MAX_SIMULATION_BYTES,
    SimulationTooLarge,
    check_size,
    estimate_bytes,
)

GH200 = plan.profiles.get("gh200")
HUGE = plan.ModelShape(layers=100_000, hidden=100_000, heads=100, vocab=50257, seq=4096)


def test_huge_shape_is_refused_before_allocating() -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(SimulationTooLarge) as info:
            plan.simulate(HUGE, GH200)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0  # the old simulator ran until the OOM killer came
    assert peak < 20e6  # nothing per parameter tensor or per bucket was built
    msg = str(info.value)
    for word in ("layers=100000", "hidden=100000", "1,200,003 parameter tensors",
                 "100,002 layers", "GiB", "fewer layers"):
        assert word in msg, (word, msg)
    assert isinstance(info.value, ValueError)  # the CLI's and the widgets' error type


@pytest.mark.parametrize("call", [
    lambda: plan.tune(HUGE, GH200),
    lambda: plan.fit_problems(HUGE, GH200, "superoffload"),
    lambda: plan.simulate(HUGE, GH200, "zero-offload"),
    lambda: plan.choose_weights(HUGE, GH200),
], ids=["tune", "fit_problems", "zero-offload", "choose_weights"])
def test_every_entry_point_refuses(call) -> None:
    with pytest.raises(SimulationTooLarge, match="too large to simulate"):
        call()


def test_cli_refuses_with_exit_2(capsys) -> None:
    argv = ["simulate", "--layers", "100000", "--hidden", "100000", "--heads", "100"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "too large to simulate" in err and "100000" in err


def test_estimate_is_an_upper_bound_of_a_real_run() -> None:
    # the worst case per tensor: 4 KiB buckets, one bucket per parameter tensor
    shape = plan.ModelShape(layers=300, hidden=256, heads=4, vocab=1000, seq=64)
    tracemalloc.start()
    try:
        res = plan.simulate(shape, GH200, config=OffloadConfig(bucket_bytes=4096))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(res.plan.bucket_plan.buckets) > 7 * shape.layers
    assert peak <= estimate_bytes(shape)
    # and the bound scales with tensors and layers only, not with the parameter count
    wide = shape.replace(hidden=100_000, heads=100)
    assert estimate_bytes(wide) == estimate_bytes(shape)
    check_size(plan.ModelShape(layers=1000, hidden=128000, heads=1000, vocab=50257, seq=1024))
    with pytest.raises(SimulationTooLarge):
        check_size(shape, limit_bytes=estimate_bytes(shape) - 1)
    assert MAX_SIMULATION_BYTES == 1 << 30
