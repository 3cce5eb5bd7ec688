"""The tuner's measured Apply made conclusive: an A/B that cannot yet tell the predicted
change from no change is lengthened from the tuner ("Measure longer": more pairs, pooled
with the first ones) until its interval does, or it says that it cannot; and the comparison
with ZeRO-Offload says why, on the same (calibrated) profile."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import superoffload as so
from superoffload import plan
from superoffload.telemetry.abtest import (
    MAX_PAIRS,
    ABResult,
    analyse,
    combine,
    lengthen,
    pairs_needed,
    resolves,
)
from superoffload.widgets.tuner.core import prediction_rows
from superoffload.widgets.tuner.tuner import OffloadTuner

pytest.importorskip("ipywidgets")
SHAPE = plan.ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=32, micro_batch=4)


def result(pairs: list[float], predicted: float | None) -> ABResult:
    return dataclasses.replace(
        analyse([[1.0]] * len(pairs), [[1.0 + r] for r in pairs], changes={"ratio": (0.5, 0.8)},
                predicted_change=predicted), pair_changes=tuple(pairs))


def test_pooled_trials_resolve_what_one_could_not() -> None:
    noisy = result([-0.12, 0.05, -0.08, 0.09, -0.03], predicted=-0.08)
    assert noisy.within_noise and not resolves(noisy), "[-12%, +9%] holds 0 and -8%"
    need = pairs_needed(noisy)
    width = noisy.ci[1] - noisy.ci[0]
    assert need == pytest.approx(5 * (width / 0.08) ** 2, abs=1)
    more, why = lengthen(noisy)
    assert more == need - 5 and f"~{more} more pairs" in why
    second = result([-0.05, -0.04, -0.06, -0.03, -0.045, -0.05], predicted=-0.08)
    both = combine([noisy, second])
    assert both.pairs == 11 and both.pair_changes == noisy.pair_changes + second.pair_changes
    assert resolves(both) and lengthen(both)[0] == 0, both.line()
    hopeless = result([-0.5, 0.4, -0.3, 0.45, -0.2], predicted=-0.001)
    more, why = lengthen(hopeless)
    assert more == 0 and why.startswith("cannot resolve") and f"the {MAX_PAIRS}" in why
    with pytest.raises(ValueError, match="different changes"):
        combine([noisy, dataclasses.replace(second, changes={"ratio": (0.5, 0.9)})])


def test_measure_longer_runs_more_pairs_and_pools_them() -> None:
    from superoffload.data import BatchSampler, load_tokens
    from superoffload.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    config = so.presets.tiny_cpu().replace(bucket_bytes=64 * 1024, ratio=0.8)
    batches = BatchSampler(load_tokens()[:20000], batch_size=2, seq_len=16, seed=0)
    with so.initialize(model, optimizer={"lr": 1e-3}, config=config) as engine:
        tuner = OffloadTuner(model, engine=engine, micro_batch=2, compare_baseline=False,
                             ab_block=2, ab_pairs=5, calibrate_after=None)
        # the first measurement of ratio 0.5 -> 0.8, as Apply left it: not conclusive
        tuner.measured = result([-0.09, 0.01, -0.05, 0.005, -0.07], predicted=-0.08)
        more = lengthen(tuner.measured)[0]
        assert 0 < more <= 5, more
        trial = tuner.measure_longer()
        assert trial.pairs == more and trial.old == {"ratio": 0.5} and trial.new == {"ratio": 0.8}
        assert "measuring longer" in tuner.status_line and tuner.measure_button.disabled
        ratios = []
        for _ in range(2 * more * 3 + 6):  # blocks of 2 + 1 settling iteration per switch
            x, y = batches.next_batch()
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            ratios.append(engine.config.ratio)
            if trial.done:
                break
        assert trial.done and ratios[0] == 0.5, "the old settings came back first"
        assert tuner.measured.pairs == 5 + more, "the new pairs pooled with the first five"
        assert engine.config.ratio == 0.8 and tuner.status_line.startswith("measured: ")
        assert tuner.measure_button.disabled == (lengthen(tuner.measured)[0] == 0)


def test_the_comparison_with_zero_offload_says_why_on_the_same_profile() -> None:
    cpu = plan.profiles.get("cpu-laptop")
    tuner = OffloadTuner(SHAPE, cpu, debounce_s=0, calibrate_after=None)
    rows = dict((label, value) for label, value, _ in prediction_rows(tuner.prediction))
    assert "vs ZeRO-Offload" in rows and "why" in rows
    assert "device waits" in rows["why"] or "adds" in rows["why"]
    assert cpu.device_type == "cpu" and 'the "device" here is this CPU' in rows["why"]
    # calibration swaps the profile: ZeRO-Offload is predicted on the same one, like with like
    slower = dataclasses.replace(cpu, name="cpu-laptop-calibrated",
                                 device_achieved_tflops=cpu.device_achieved_tflops / 3)
    tuner.use_calibration(SimpleNamespace(profile=slower, line=lambda: "fitted"))
    want = plan.simulate(SHAPE, slower, system="zero-offload").iteration_s
    assert tuner.prediction.baseline_s == pytest.approx(want)
