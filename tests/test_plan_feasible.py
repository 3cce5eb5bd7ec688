"""Will it fit: when host memory binds, the search walks the ratio down
from 1 (plan/feasible.py); every "does not fit" verdict is checked against a dense grid of
the settings that change memory, and every fitting answer fits."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from superoffload import plan
from superoffload.config import MiB, OffloadConfig
from superoffload.plan import feasible
from superoffload.plan.techniques import resolve
from superoffload.plan.tuning import BUCKET_CHOICES, RATIO_CHOICES

MEASURED = plan.profiles.get("h200-pcie-measured")
GB200 = plan.profiles.get("gb200")
RATIOS = sorted(set(np.round(np.linspace(0.0, 1.0, 51), 4)) | set(RATIO_CHOICES))


def grid(allow_bf16: bool = False, ratios=RATIOS):
    """Every setting that changes memory: ratio x weights (x prefetch for flow) x bucket size x
    casting x moments (bf16 only when allowed); inverse rollback (a snapshot only adds)."""
    dtypes = ("fp32", "bf16") if allow_bf16 else ("fp32",)
    casts = (("host", "host"), ("device", "device"))
    for dtype, bucket, (g, p) in itertools.product(dtypes, (min(BUCKET_CHOICES),
                                                            64 * MiB), casts):
        base = OffloadConfig(bucket_bytes=bucket, grad_cast=g, param_cast=p, rollback="inverse",
                             optimizer_state_dtype=dtype)
        for r in ratios:
            yield base.replace(weights="stationary", ratio=float(r))
        for depth in (1, 2):
            yield base.replace(weights="flow", prefetch_depth=depth)


def grid_fits(shape, prof, allow_bf16: bool = False, ratios=RATIOS) -> OffloadConfig | None:
    for cfg in grid(allow_bf16, ratios):
        if not plan.fit_problems(shape, prof, "superoffload", cfg):
            return cfg
    return None


# Since the host figure is the engine's own rule (14 B/param where gradients are cast on the
# host and weights on the device), three of these fit every bucket on the host of the real
# machine: a host of 80% of it keeps the host binding
HOST_80 = {"host_memory_bytes": 0.8 * MEASURED.host_memory_bytes}


@pytest.mark.parametrize("name, profile, seq", [
    ("llama-3-8b", MEASURED.replace(**HOST_80), 4096),     # host binds; fits at ratio ~0.3
    ("qwen2.5-14b", GB200.replace(host_memory_bytes=0.8 * GB200.host_memory_bytes), 4096),
    ("gemma-2-9b", MEASURED, 4096),
    ("falcon-7b", MEASURED.replace(**HOST_80), 4096),
])
def test_host_bound_models_are_trainable(name, profile, seq):
    if name in ("gemma-2-9b", "falcon-7b"):
        pytest.importorskip("transformers", reason="read on the meta device (the hf extra)")
    shape = plan.ModelShape.from_hf_config(name, seq=seq)
    assert plan.fit_problems(shape, profile, "superoffload", OffloadConfig(ratio=1.0)), \
        "every bucket on the host does not fit: the host binds"
    assert not plan.fit_problems(shape, profile, "superoffload")
    cfg, why, pred = plan.tune(shape, profile)
    assert pred.fits and cfg.weights == "stationary" and 0.0 < cfg.ratio < 0.95, (cfg.ratio, why)
    assert not plan.fit_problems(shape, profile, "superoffload", cfg)


def test_largest_model_comes_from_the_same_search():
    best = plan.max_model_size(MEASURED, "superoffload", seq=1024)
    gpu = plan.max_model_size(MEASURED, "gpu", seq=1024)
    assert best > 10.4e9 > gpu  # was 6.7 B, equal to plain GPU, before the search
    layers = round((best / (12 * 128 * 128)) ** (1 / 3))
    fits = plan.gpt_by_layers(layers, seq=1024, micro_batch=1)
    assert fits.params == best
    bigger = plan.gpt_by_layers(layers + 1, seq=1024, micro_batch=1)
    assert grid_fits(bigger, MEASURED) is None  # one layer more: nothing in the grid fits


@pytest.mark.parametrize("device_gb, host_gb", [(60, 121), (134, 40), (40, 60), (134, 70)])
def test_every_does_not_fit_verdict_has_no_fitting_setting(device_gb, host_gb):
    shape = plan.ModelShape.from_hf_config("llama-3-8b", seq=4096)
    prof = MEASURED.replace(device_memory_bytes=device_gb * 1e9, host_memory_bytes=host_gb * 1e9)
    found = grid_fits(shape, prof)
    try:
        cfg, _, pred = plan.tune(shape, prof)
    except plan.InfeasibleError as exc:
        assert found is None, f"the tuner said {exc} but {found} fits"
        assert plan.fit_problems(shape, prof, "superoffload")
        return
    assert pred.fits and not plan.fit_problems(shape, prof, "superoffload")


def test_verdicts_agree_with_the_grid_on_random_machines():
    rng = random.Random(18)
    shape = plan.ModelShape(layers=6, hidden=1024, heads=8, vocab=50257, seq=2048,
                            micro_batch=2)
    ratios = np.linspace(0.0, 1.0, 26)
    seen = {True: 0, False: 0}
    for _ in range(16):
        prof = MEASURED.replace(device_memory_bytes=rng.uniform(0.5, 8) * 1e9,
                                host_memory_bytes=rng.uniform(0.5, 8) * 1e9)
        for allow in (False, True):
            verdict = not plan.fit_problems(shape, prof, "superoffload", allow_bf16_moments=allow)
            assert verdict == (grid_fits(shape, prof, allow, ratios) is not None), (prof, allow)
            seen[verdict] += 1
    assert seen[True] and seen[False]  # both verdicts were exercised


def test_the_fitting_window_ends_where_every_bucket_prefix_says():
    """``ratio_window`` (whose ends the tuner adds to its ratio choices) against every prefix
    of buckets, each checked alone with fit_problems: its two ends are the lowest and the
    highest prefix that fit. A machine where the device binds at low ratios and the host at
    high ones, so both bisections run (a window one bucket too low once survived)."""
    shape = plan.ModelShape(layers=6, hidden=1024, heads=8, vocab=50257, seq=2048,
                            micro_batch=2)
    # 4.5 GB: the activations (2.5 GB with the loss's fp32 gradients) leave room for the state
    # of about 90% of the parameters (4.0 GB did while every gradient was charged resident)
    prof = MEASURED.replace(device_memory_bytes=4.5e9, host_memory_bytes=1.0e9)
    found = feasible.search(shape, prof, OffloadConfig(), bucket_bytes=min(BUCKET_CHOICES))
    cfg = found.config
    assert cfg is not None and cfg.weights == "stationary"
    buckets = resolve(shape, prof, "superoffload", cfg.replace(ratio=1.0), None).bucket_plan.buckets
    cum = [0, *itertools.accumulate(b.numel for b in buckets)]
    prefixes = [c / cum[-1] for c in cum]  # exactly k buckets offloaded
    fitting = [r for r in prefixes
               if not plan.fit_problems(shape, prof, "superoffload", cfg.replace(ratio=r))]
    assert 0.0 < fitting[0] < fitting[-1] < 1.0  # both sides bind: the window is inside
    assert fitting == [r for r in prefixes if fitting[0] <= r <= fitting[-1]]  # one interval
    assert found.ratio_window == (fitting[0], fitting[-1]) and cfg.ratio == fitting[-1]


def test_the_tuner_also_starts_where_the_least_is_offloaded():
    # Qwen2.5-14B on one B200 of a GB200: the defaults fit (ratio 0.9, weights cast on the
    # device), and one knob at a time only walks the ratio down to 0.4 with that casting
    # (1.10 s); the fastest setting that fits, ratio 0.31 with both casts on the host, is
    # the memory search's low end: the tuner starts from there too
    shape = plan.ModelShape.from_hf_config("qwen2.5-14b", seq=4096)
    cfg, _, pred = plan.tune(shape, GB200)
    assert pred.fits and cfg.ratio < 0.35 and pred.iteration_s < 0.9
