"""Apply measured as an interleaved A/B: the statistics (telemetry/abtest.py)
by their properties, and the driver (runtime/ab_trial.py) on an engine stand-in whose
iteration time depends on its settings, on a simulated clock (no wall-clock timing)."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.runtime.ab_trial import ABTrial
from superoffload.telemetry import abtest
from superoffload.telemetry.recorder import Recorder


def blocks(rng: random.Random, pairs: int, k: int, old_s: float, new_s: float,
           noise: float, drift: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """Alternating A/B blocks; multiplicative noise (one-sided spikes too) and a linear drift."""
    a, b, t = [], [], 0
    for _ in range(pairs):
        for arm, base in ((a, old_s), (b, new_s)):
            blk = []
            for _ in range(k):
                spike = 1.5 if rng.random() < 0.05 else 1.0
                blk.append(base * (1 + drift * t) * (1 + rng.gauss(0, noise)) * spike)
                t += 1
            arm.append(blk)
    return a, b


def test_interval_is_the_sign_test_order_statistic():
    lo, hi, cover = abtest.median_interval([0.05, -0.01, 0.02, 0.03, 0.01, 0.04])
    assert (lo, hi) == (-0.01, 0.05) and cover == pytest.approx(1 - 2 / 64)
    # more pairs: a narrower interval at >= 90% coverage, never below
    xs = [i / 100 for i in range(20)]
    lo, hi, cover = abtest.median_interval(xs)
    assert 0.9 <= cover < 0.99 and 0.0 < lo < hi < 0.19
    assert abtest.binomial_cdf(0, 5) == pytest.approx(1 / 32)


def test_no_change_is_within_noise_at_the_stated_coverage():
    """A statistical property, not a timing test: over 400 seeded trials with no real change,
    the interval holds 0 at least as often as its coverage says (minus sampling error)."""
    rng = random.Random(0)
    held = 0
    for _ in range(400):
        a, b = blocks(rng, pairs=6, k=4, old_s=0.01, new_s=0.01, noise=0.05)
        held += abtest.analyse(a, b, changes={"ratio": (0.5, 0.8)}).within_noise
    assert held / 400 >= 0.969 - 3 * (0.969 * 0.031 / 400) ** 0.5


def test_a_real_change_is_found_and_a_drift_cancels():
    rng = random.Random(1)
    a, b = blocks(rng, pairs=6, k=4, old_s=0.010, new_s=0.008, noise=0.02)
    res = abtest.analyse(a, b, changes={"ratio": (0.5, 0.8)}, predicted_change=-0.4)
    assert res.verdict == "faster" and res.ci[0] <= -0.2 <= res.ci[1] and res.ci[1] < 0
    assert res.prediction_inside is False and "outside the interval" in res.line()
    # load rising 1% per iteration: comparing B with the A blocks on both sides cancels it
    a, b = blocks(random.Random(2), pairs=6, k=4, old_s=0.01, new_s=0.01, noise=0.0,
                  drift=0.01)
    naive = statistics.median(statistics.median(bb) / statistics.median(aa) - 1
                              for aa, bb in zip(a, b))  # each B against the A before it
    res = abtest.analyse(a, b, changes={"ratio": (0.5, 0.8)})
    assert naive > 0.03 and abs(res.change) < 0.01 and res.within_noise
    assert res.to_dict()["verdict"] == "within noise"


class SimEngine:
    """Stands in for the engine: `reconfigure` applies where the next iteration starts, an
    iteration costs cost(config) on a simulated clock, and `step()` is a torch optimizer's."""

    def __init__(self, cost, noise: float = 0.0, seed: int = 0) -> None:
        self.config = OffloadConfig(ratio=0.5)
        self.iteration = 0
        self.telemetry = Recorder()
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        self.now = 0.0
        self.cost, self.noise, self.rng = cost, noise, random.Random(seed)
        self.pending: dict = {}
        self.ratios: list[float] = []

    def reconfigure(self, **changes):
        self.config.replace(**{**self.pending, **changes})  # validates, as the engine does
        self.pending.update(changes)

    def train(self, n: int) -> None:
        for _ in range(n):
            if self.pending:
                self.config, self.pending = self.config.replace(**self.pending), {}
            self.ratios.append(self.config.ratio)
            self.now += self.cost(self.config) * (1 + self.rng.gauss(0, self.noise))
            self.iteration += 1
            self.optimizer.step()


def test_trial_alternates_settles_and_ends_on_the_new_settings():
    engine = SimEngine(lambda c: 0.010 if c.ratio == 0.5 else 0.008, noise=0.01)
    done = []
    trial = ABTrial(engine, {"ratio": 0.5}, {"ratio": 0.8}, block=3, pairs=5, settle=1,
                    predicted_change=-0.2, on_done=done.append, clock=lambda: engine.now).start()
    engine.train(3)
    assert not trial.done and "pair 1 of 5" in trial.progress
    engine.train(60)
    assert trial.done and done == [trial] and engine.config.ratio == 0.8
    res = trial.result
    assert res is not None and res.pairs == 5 and res.block == 3
    assert res.change == pytest.approx(-0.2, abs=0.03) and res.verdict == "faster"
    assert res.prediction_inside
    # A blocks ran ratio 0.5, B blocks 0.8, with one settling iteration after each switch
    runs = [r for r, _ in __import__("itertools").groupby(engine.ratios[:40])]
    assert runs[:4] == [0.5, 0.8, 0.5, 0.8]
    assert all(len(blk) == 3 for blk in trial.a_blocks + trial.b_blocks)
    notes = [n.text for n in engine.telemetry.notes()]
    assert notes[0].startswith("A/B started") and notes[-1] == res.line()
    engine.train(5)  # finished: the hook is inert, the new setting stays
    assert set(engine.ratios[-5:]) == {0.8}


def test_cancel_and_refusals_never_break_training():
    engine = SimEngine(lambda c: 0.01)
    trial = ABTrial(engine, {"ratio": 0.5}, {"ratio": 0.8}, block=2, pairs=5,
                    clock=lambda: engine.now).start()
    engine.train(4)
    trial.cancel("run stopped")
    engine.train(2)
    assert trial.done and trial.result is None and engine.config.ratio == 0.8
    assert "run stopped" in engine.telemetry.notes()[-1].text
    with pytest.raises(ConfigError):
        ABTrial(engine, {"ratio": 0.8}, {"ratio": 7.0}).start()  # refused in the caller
    broken = SimEngine(lambda c: 0.01)
    trial = ABTrial(broken, {"ratio": 0.5}, {"ratio": 0.8}, block=1, pairs=5,
                    clock=lambda: broken.now).start()

    def refuse(**_):
        raise ConfigError("engine closed")

    broken.reconfigure = refuse  # type: ignore[method-assign]
    broken.train(6)  # the switch fails inside the hook: recorded, not raised
    assert trial.done and "engine closed" in trial.error
    # a second trial on the same engine replaces the first
    engine = SimEngine(lambda c: 0.01)
    first = ABTrial(engine, {"ratio": 0.5}, {"ratio": 0.8}, clock=lambda: engine.now).start()
    second = ABTrial(engine, {"ratio": 0.5}, {"ratio": 0.6}, clock=lambda: engine.now).start()
    assert first.done and "replaced" in first.error and not second.done


def test_the_latest_result_is_found_among_notes():
    a, b = blocks(random.Random(3), pairs=5, k=2, old_s=0.01, new_s=0.01, noise=0.01)
    res = abtest.analyse(a, b, changes={"ratio": (0.5, 0.8)})
    notes = [(3, "reconfigure applied: ratio 0.5 -> 0.8"), (4, "A/B started: ratio 0.5 -> 0.8"),
             (30, res.line()), (31, "reconfigure applied: ratio 0.8 -> 0.9")]
    assert abtest.latest_result(notes) == res.line()
    assert res.line().startswith(abtest.RESULT_PREFIX)
    assert abtest.latest_result(notes[:2]) is None
