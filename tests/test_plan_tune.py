"""Tuner: feasible, respects constraints, refuses the impossible with the reason; capacity."""

from __future__ import annotations

import json
import math

import pytest
import torch

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.models.gpt import GPT, gpt_tiny

GH200 = plan.profiles.get("gh200")
PCIE = plan.profiles.get("h100-pcie")
SHAPE = plan.ModelShape(layers=40, hidden=5120, heads=40, vocab=50257, seq=4096, micro_batch=1)


@pytest.fixture(scope="module")
def tuned() -> tuple[OffloadConfig, str, plan.SimResult]:
    return plan.tune(SHAPE, GH200)


def test_tune_returns_a_feasible_better_config(tuned) -> None:
    cfg, why, pred = tuned
    assert isinstance(cfg, OffloadConfig) and cfg.validate() is cfg
    assert pred.fits
    default = plan.simulate(SHAPE, GH200, config=OffloadConfig())
    assert pred.iteration_s <= default.iteration_s
    # the prediction is what the config simulates to
    again = plan.simulate(SHAPE, GH200, config=cfg)
    assert again.iteration_s == pytest.approx(pred.iteration_s)
    for word in ("ratio", "bucket_bytes", "speculation", "ZeRO-Offload", "TFLOPS"):
        assert word in why
    notes = cfg.extra["planner"]
    assert notes["predicted_iteration_s"] == pytest.approx(pred.iteration_s)
    json.dumps(cfg.to_dict())  # the explanation travels in a JSON-safe form


def test_tune_is_a_local_optimum(tuned) -> None:
    cfg, _, pred = tuned
    for field, values in (("ratio", (0.8, 0.9, 1.0)), ("speculation", ("off",)),
                          ("bucket_bytes", (16 << 20, 64 << 20))):
        for v in values:
            other = plan.simulate(SHAPE, GH200, config=cfg.replace(**{field: v}))
            assert not other.fits or other.iteration_s >= pred.iteration_s * (1 - 0.003), (field, v)


def test_constraints_are_respected() -> None:
    cons = plan.Constraints(device_memory_bytes=60e9, cpu_cores=16, fixed={"speculation": "off"},
                            max_grad_norm=1.0)
    cfg, why, pred = plan.tune(SHAPE, GH200, cons)
    assert pred.memory["device"] <= 60e9
    assert pred.plan.threads <= 16
    assert cfg.speculation == "off" and cfg.max_grad_norm == 1.0
    assert "fixed by the constraints" in why
    with pytest.raises(ValueError, match="cpu_cores"):
        plan.tune(SHAPE, GH200, plan.Constraints(cpu_cores=0))


def test_infeasible_requests_name_the_reason() -> None:
    huge = plan.ModelShape(layers=96, hidden=12288, heads=96, vocab=50257, seq=2048)
    with pytest.raises(plan.InfeasibleError,
                       match=r"needs \d+ GB host memory, profile h100-pcie has"):
        plan.tune(huge, PCIE)
    with pytest.raises(ValueError, match="host memory"):
        plan.tune(SHAPE, GH200, plan.Constraints(host_memory_bytes=100e9))


def test_tune_accepts_a_module() -> None:
    torch.manual_seed(0)
    cfg, _, pred = plan.tune(GPT(gpt_tiny()), plan.profiles.get("cpu-laptop"), seq=64)
    assert pred.fits and pred.shape.params == GPT(gpt_tiny()).num_params()
    with pytest.raises(TypeError, match="seq"):
        plan.tune(GPT(gpt_tiny()), GH200)


def test_max_model_size_orders_the_policies() -> None:
    sizes = {s: plan.max_model_size(GH200, system=s, seq=1024, micro_batch=1) for s in plan.SYSTEMS}
    assert 0 < sizes["gpu"] < sizes["zero-offload"] <= sizes["superoffload"]
    # GPU-only is bounded by 16 B/param (bf16 weight and gradient, fp32 master, m, v) of
    # 91 GB usable HBM
    assert 3e9 < sizes["gpu"] < 96e9 * 0.95 / 16
    # the answer is tight: it fits, one layer more does not
    layers = round((sizes["superoffload"] / (12 * 128 * 128)) ** (1 / 3))
    fit = plan.gpt_by_layers(layers, seq=1024, micro_batch=1)
    assert fit.params == sizes["superoffload"]
    assert not plan.fit_problems(fit, GH200, "superoffload")
    one_layer_more = plan.gpt_by_layers(layers + 1, seq=1024, micro_batch=1)
    assert plan.fit_problems(one_layer_more, GH200, "superoffload")
    bigger_host = GH200.replace(host_memory_bytes=960e9)
    assert plan.max_model_size(bigger_host, seq=1024) > sizes["superoffload"]
    with pytest.raises(ValueError, match="system"):
        plan.max_model_size(GH200, system="fsdp")


def test_memory_by_hand_for_zero_offload() -> None:
    # DeepSpeed ZeRO-2 + offload_optimizer (plan/deepspeed.py, modelled on DeepSpeed's own
    # ZeRO stage 1/2 code)
    shape = plan.ModelShape(layers=4, hidden=1024, heads=8, vocab=50257, seq=1024)
    res = plan.simulate(shape, GH200, "zero-offload")
    n = shape.params
    largest = 50257 * 1024  # the tied embedding
    # device: flat bf16 weights (2n), the ipg reduce bucket (min(5e8, n) bf16 elements: the
    # whole model here), per-parameter gradient temporaries of the largest parameter (its
    # autograd grad 2 + temp_grad_buffer_for_gpu_offload 2 + fp32 4 + fp64 norm 8 + float 4)
    assert res.memory["device"] == pytest.approx(2 * n + 2 * n + 20 * largest
                                                 + shape.activation_bytes())
    # host: the pinned fp32 master and gradient and bf16 buffer (each rounded up to a power of
    # two by PyTorch's pinned allocator), pageable m and v, the pinned
    # temp_grad_buffer_for_cpu_offload (plan/deepspeed.py)
    def p2(x: float) -> float:
        return float(2 ** math.ceil(math.log2(x)))

    assert res.memory["host"] == 2 * p2(4 * n) + p2(2 * n) + 8 * n + p2(2 * largest)
    snap = plan.simulate(shape, GH200, config=OffloadConfig(ratio=1.0, rollback="snapshot",
                                                           grad_cast="host", param_cast="host"))
    # ours, host casts: master, m, v 12 + bf16 gradient buffer 2 + bf16 copy 2, + 12 B/param
    # pre-step snapshot (plan/storage.py's rule, what the engine allocates)
    assert snap.memory["host"] == pytest.approx(28 * n)
