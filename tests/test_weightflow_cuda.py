"""Weight-flow on the CUDA backend (pinned homes, the H2D stream, events). Skipped without a GPU.

Same differential check as on the CPU (tests/test_weightflow.py): bf16 weights, clipping,
activation checkpointing; max abs difference of fp32 masters after 20 steps < 1e-3 against
the plain PyTorch loop. The memory check reads the CUDA allocator instead of DeviceMeter.
"""

from __future__ import annotations

import pytest
import torch
from _engine_ref import max_diff, train_engine, train_reference
from _tiny_models import batches, make_model
from test_weightflow import make_ckpt_model

import superoffload as so

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 20


def cuda_batches(n):
    return [(x.cuda(), y.cuda()) for x, y in batches(n)]


@pytest.mark.parametrize("ckpt", [False, True])
def test_cuda_flow_matches_reference(ckpt):
    make = make_ckpt_model if ckpt else (lambda dtype, **kw: make_model(dtype=dtype, **kw))
    data = cuda_batches(STEPS)
    ref = train_reference(make(torch.bfloat16, n_blocks=4).cuda(), data, steps=STEPS, max_norm=0.5)
    config = so.OffloadConfig(device="cuda", bucket_bytes=4096, weights="flow", prefetch_depth=1,
                              max_grad_norm=0.5)
    got, stats = train_engine(make(torch.bfloat16, n_blocks=4).cuda(), data, config, steps=STEPS)
    assert max_diff({k: v.cpu() for k, v in ref.items()}, got) < 1e-3
    assert stats.iterations == STEPS


def test_cuda_flow_homes_pinned_and_weights_released():
    model = make_model(dtype=torch.bfloat16, n_blocks=6).cuda()
    config = so.OffloadConfig(device="cuda", bucket_bytes=4096, weights="flow", prefetch_depth=1)
    with so.initialize(model, {"lr": 1e-3}, config) as engine:
        assert all(t.is_pinned() for b in engine.state.buffers for t in b.flat)
        for x, y in cuda_batches(3):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        assert all(p.numel() == 0 for blk in model.blocks for p in blk.parameters())
        assert engine.weights.flow is not None
        assert engine.weights.flow.stats.peak_resident_blocks == 2
