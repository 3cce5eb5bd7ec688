"""The CUDA device ops (streams, pinned buffers, events). Skipped without a GPU.

Same differential check as on the CPU: the engine on CUDA matches master-weight AdamW.
"""

from __future__ import annotations

import pytest
import torch
from _engine_ref import max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 20


def on_cuda(model):
    return model.to("cuda")


def cuda_batches(n):
    return [(x.cuda(), y.cuda()) for x, y in batches(n)]


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cast", ["host", "device"])
def test_cuda_engine_matches_reference(ratio, cast):
    data = cuda_batches(STEPS)
    ref = train_reference(on_cuda(make_model(dtype=torch.bfloat16, frozen=True)), data,
                          steps=STEPS, max_norm=0.5, two_groups=True)
    config = so.OffloadConfig(device="cuda", bucket_bytes=4096, ratio=ratio, grad_cast=cast,
                              param_cast=cast, max_grad_norm=0.5)
    got, stats = train_engine(on_cuda(make_model(dtype=torch.bfloat16, frozen=True)), data,
                              config, steps=STEPS, two_groups=True)
    assert max_diff({k: v.cpu() for k, v in ref.items()}, got) < 1e-3
    assert stats.iterations == STEPS


def test_cuda_buffers_pinned_and_streams_separate():
    model = on_cuda(make_model(dtype=torch.bfloat16))
    config = so.OffloadConfig(device="cuda", bucket_bytes=4096, ratio=0.5)
    with so.initialize(model, {"lr": 1e-3}, config) as engine:
        host = [b for b in engine.state.buffers if not b.on_device]
        assert host and all(t.is_pinned() for b in host for t in b.flat)
        device = [b for b in engine.state.buffers if b.on_device]
        assert all(t.is_cuda for b in device for t in b.flat)
        ops = engine.device_ops
        streams = {ops.d2h_stream, ops.h2d_stream, torch.cuda.current_stream()}
        assert len(streams) == 3
        for x, y in cuda_batches(3):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        assert engine.iteration == 3
        assert {"d2h", "h2d", "cpu_step"} <= {s.kind for s in engine.telemetry.spans()}
