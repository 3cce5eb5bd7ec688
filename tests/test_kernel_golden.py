"""Replay the golden fixture (written by PyTorch: scripts/make_golden.py) through our fp32
kernel: every tensor within fp32 rounding of torch.optim's float64 result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import superoffload.kernels as K

FIXTURE = Path(__file__).parent / "fixtures" / "cpu_adam_golden.pt"


def _cases():
    return sorted(torch.load(FIXTURE)["cases"].items())


@pytest.mark.parametrize("name,case", _cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_kernel_reproduces_pytorch_golden_state(name, case):
    hp = case["hparams"]
    p = case["p0"].clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for k, g in enumerate(case["grads"]):
        K.adam_step(p, g.clone(), m, v, step=k + 1, lr=hp["lr"], beta1=hp["betas"][0],
                    beta2=hp["betas"][1], eps=hp["eps"], weight_decay=hp["weight_decay"],
                    adamw_mode=hp["adamw_mode"])
    # 4 steps of lr <= 1e-2 on |p| ~ 1: a few fp32 ulps of p; moments to fp32 rounding
    assert torch.allclose(p.double(), case["p"], rtol=0, atol=1e-6), name
    assert torch.allclose(m.double(), case["exp_avg"], rtol=1e-6, atol=1e-8)
    assert torch.allclose(v.double(), case["exp_avg_sq"], rtol=1e-6, atol=1e-10)


def test_fixture_is_small_and_regenerable():
    import runpy

    assert FIXTURE.stat().st_size < 16_000
    script = Path(__file__).parents[1] / "scripts" / "make_golden.py"
    fresh = runpy.run_path(str(script))["make"]()
    saved = torch.load(FIXTURE)
    for name, case in fresh["cases"].items():
        for key in ("p0", "grads"):
            assert torch.equal(case[key], saved["cases"][name][key])
        assert torch.allclose(case["p"], saved["cases"][name]["p"], rtol=0, atol=1e-12)
