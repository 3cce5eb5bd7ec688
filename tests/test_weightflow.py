"""Weight-flow runtime (paper §4.5) on the CPU backend: numerics, fetch schedule, memory bound.

Differential tolerances are the engine's (tests/test_engine_diff.py): max abs difference of
fp32 master weights after 20 steps against the plain PyTorch loop (tests/_engine_ref.py):
1e-5 for an fp32 model, 1e-3 for a bf16 model. Against weight-stationary with every bucket
on the host (ratio 1, host-side weight casting) weight-flow runs the same arithmetic in the
same order, so the difference must be exactly 0.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff, train_engine, train_reference
from _tiny_models import TinyGPT, batches, make_model
from torch.utils.checkpoint import checkpoint

import superoffload as so
from superoffload.models.gpt import GPT, gpt_tiny
from superoffload.runtime.device_meter import DeviceMeter

STEPS = 20
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


cfg = cpu_config


class CkptTinyGPT(TinyGPT):
    """TinyGPT with every block under activation checkpointing."""

    reentrant = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        if self.frozen is not None:
            x = x + self.frozen(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.head(self.ln_f(x)).float()
        flat = logits.view(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, targets.view(-1))


def make_ckpt_model(dtype=torch.float32, reentrant=False, **kw):
    torch.manual_seed(0)
    model = CkptTinyGPT(**kw).to(dtype)
    model.reentrant = reentrant
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [1, 2])
def test_flow_matches_reference_and_stationary(dtype, depth):
    data = batches(STEPS)
    kw = dict(frozen=True, n_blocks=4)
    ref = train_reference(make_model(dtype=dtype, **kw), data, steps=STEPS, max_norm=0.5,
                          two_groups=True)
    stat, _ = train_engine(make_model(dtype=dtype, **kw), data,
                           cfg(ratio=1.0, param_cast="host", max_grad_norm=0.5), steps=STEPS,
                           two_groups=True)
    flow, stats = train_engine(make_model(dtype=dtype, **kw), data,
                               cfg(weights="flow", prefetch_depth=depth, max_grad_norm=0.5),
                               steps=STEPS, two_groups=True)
    assert max_diff(ref, flow) < TOL[dtype]
    assert max_diff(stat, flow) == 0.0
    # clipping at 0.5 fires: speculative steps were rolled back and replayed under flow too
    assert stats.clipped_steps > 0 and stats.replays > 0


def test_close_leaves_the_model_with_its_latest_weights():
    model = make_model(dtype=torch.bfloat16, n_blocks=3)
    with so.initialize(model, dict(HYPER), cfg(weights="flow")) as engine:
        for x, y in batches(3):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
    for name, p in model.named_parameters():  # every block resident again after close()
        if p.requires_grad:
            assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flow_with_activation_checkpointing(dtype):
    data = batches(STEPS)
    ref = train_reference(make_ckpt_model(dtype, n_blocks=4), data, steps=STEPS, max_norm=1.0)
    model = make_ckpt_model(dtype, n_blocks=4)
    with so.initialize(model, dict(HYPER), cfg(weights="flow", prefetch_depth=1,
                                               max_grad_norm=1.0)) as engine:
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        flow = engine.weights.flow
        assert flow is not None
        # the recompute ran inside backward with each block resident (it would fail on the
        # released 0-element weights otherwise), and the schedule per iteration is unchanged
        assert flow.stats.fetch_order[:6] == [("f", 0), ("f", 1), ("f", 2), ("f", 3),
                                              ("b", 1), ("b", 0)]
        # bf16 weights on the "device" are the rounding of the masters (host-side cast)
        with engine.resident_weights():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    assert torch.equal(p.detach(), got[name].to(dtype)), name
    assert max_diff(ref, got) < TOL[dtype]


def test_flow_with_reentrant_checkpointing():
    # the forward runs under no_grad: backward meets each block only in its recompute
    data = batches(8)
    ref = train_reference(make_ckpt_model(n_blocks=4, reentrant=True), data, steps=8)
    model = make_ckpt_model(n_blocks=4, reentrant=True)
    with so.initialize(model, dict(HYPER), cfg(weights="flow", prefetch_depth=1)) as engine:
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
        st = engine.weights.flow.stats  # type: ignore[union-attr]
        assert st.peak_resident_blocks == 2
        assert st.fetch_order[:8] == [("f", 0), ("f", 1), ("f", 2), ("f", 3),
                                      ("b", 3), ("b", 2), ("b", 1), ("b", 0)]
    assert max_diff(ref, got) < TOL[torch.float32]


def test_gpt_with_checkpointing_flow_equals_stationary():
    torch.manual_seed(0)
    base = GPT(gpt_tiny(n_layer=3, checkpointing=True)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    data = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 256, (2, 16), generator=g)
                                                for _ in range(4))]
    out = {}
    for weights in ("stationary", "flow"):
        out[weights], _ = train_engine(copy.deepcopy(base), data,
                                       cfg(weights=weights, ratio=1.0, param_cast="host",
                                           bucket_bytes=16384, max_grad_norm=1.0), steps=4)
    assert max_diff(out["stationary"], out["flow"]) == 0.0


def test_gradient_accumulation_and_inline_lanes():
    data = batches(3 * 8)
    ref = train_reference(make_model(n_blocks=3), data, steps=8, gas=3, max_norm=1.0)
    for inline in (False, True):
        got, stats = train_engine(make_model(n_blocks=3), data,
                                  cfg(weights="flow", grad_accum_steps=3, max_grad_norm=1.0),
                                  steps=8, inline=inline)
        assert max_diff(ref, got) < TOL[torch.float32]
        assert stats.iterations == 8


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_depth_bounds_resident_weights(depth):
    n_blocks = 6
    model = make_model(n_blocks=n_blocks, dtype=torch.bfloat16)
    with so.initialize(model, dict(HYPER), cfg(weights="flow", prefetch_depth=depth)) as engine:
        flow = engine.weights.flow
        assert flow is not None
        sizes = flow.block_bytes
        for x, y in batches(3):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
            # nothing streamed stays in use between iterations; at most depth + 1 buffers
            # stay allocated for reuse
            assert not flow.resident and flow.resident_bytes == 0
            assert flow.held_bytes <= (depth + 1) * max(sizes)
        engine.synchronize()
        st = flow.stats
        # never more than depth + 1 blocks, and prefetch really filled them
        assert st.peak_resident_blocks == depth + 1
        assert st.peak_resident_bytes <= sum(sorted(sizes)[-(depth + 1):])
        assert st.peak_held_bytes <= (depth + 1) * max(sizes)  # incl. buffers kept for reuse
        # one iteration: forward 0..5, then backward re-fetches what forward released
        kept = depth + 1
        expect = [("f", k) for k in range(n_blocks)] + [
            ("b", k) for k in reversed(range(n_blocks - kept))]
        per_iter = len(expect)
        assert st.fetch_order[:per_iter] == expect
        assert st.fetches == 3 * per_iter
        # telemetry: weight_fetch spans on the h2d lane carrying a block's bytes
        spans = [s for s in engine.telemetry.spans() if s.kind == "weight_fetch"]
        assert len(spans) == 3 * per_iter and {s.lane for s in spans} == {"h2d"}
        assert {s.nbytes for s in spans} <= set(sizes)
        # the scalar the dashboard plots: fixed weights + at most depth + 1 blocks
        fixed = sum(p.numel() * p.element_size() for p in model.parameters()
                    if not flow.is_streamed(p))
        peaks = [s.value for s in engine.telemetry.scalars("device_weight_bytes")]
        assert len(peaks) == 3 and all(fixed < v <= fixed + st.peak_held_bytes for v in peaks)
        stationary_bytes = fixed + flow.streamed_bytes
        assert max(peaks) < stationary_bytes
        assert [s.value for s in engine.telemetry.scalars("weights_flow")] == [1.0] * 3


def test_released_blocks_hold_no_device_memory_and_grads_leave():
    model = make_model(n_blocks=4)
    with so.initialize(model, dict(HYPER), cfg(weights="flow", prefetch_depth=1)) as engine:
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        flow = engine.weights.flow
        assert flow is not None
        for block in model.blocks:
            for p in block.parameters():
                assert p.numel() == 0  # released
                assert p.grad is None  # gradient left with its bucket, device copy freed
        # the resident (tied) weight is offloaded too (weight-flow: ratio 1): its gradient
        # left with its bucket as well (runtime/departures.py)
        assert model.wte.weight.grad is None
        engine.step()


def test_checkpoint_saved_under_flow_resumes_under_both_policies(tmp_path):
    data = batches(10)
    straight, _ = train_engine(make_model(), data, cfg(weights="flow", max_grad_norm=1.0), steps=10)
    model = make_model()
    with so.initialize(model, dict(HYPER), cfg(weights="flow", max_grad_norm=1.0)) as engine:
        for x, y in data[:5]:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        engine.save_checkpoint(str(tmp_path))
        sd_model = torch.load(tmp_path / "engine.pt", weights_only=True)["model"]
        assert sd_model["blocks.0.fc1.weight"].shape == (40, 24)  # real weights, not released
    for weights in ("flow", "stationary"):
        model = make_model(seed=5)
        config = cfg(weights=weights, max_grad_norm=1.0, ratio=1.0, param_cast="host")
        with so.initialize(model, dict(HYPER), config) as engine:
            engine.load_checkpoint(str(tmp_path))
            for x, y in data[5:]:
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            got = engine.master_weights()
        assert max_diff(straight, got) == 0.0, weights


def test_flow_needs_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="ModuleList"):
        so.initialize(model, {}, cfg(weights="flow"))


def test_fp16_overflow_skips_and_plain_backward_match_stationary():
    # fp16 with a 2**24 loss scale overflows at first: SKIP rolls speculative steps back and
    # the next fetches must read the restored weights; then a plain loss.backward() loop.
    data = batches(8)
    out = {}
    for weights in ("stationary", "flow"):
        config = cfg(weights=weights, ratio=1.0, param_cast="host", initial_scale_power=24)
        got, stats = train_engine(make_model(dtype=torch.float16), data, config, steps=8)
        out[weights] = got
        assert stats.skipped_steps > 0
    assert max_diff(out["stationary"], out["flow"]) == 0.0
    ref = train_reference(make_model(), data, steps=8, max_norm=1.0)
    model = make_model()
    with so.initialize(model, dict(HYPER), cfg(weights="flow", max_grad_norm=1.0)) as engine:
        for x, y in data:
            model(x, y).backward()
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    assert max_diff(ref, got) < TOL[torch.float32]


def test_checkpoints_on_the_host_option():
    # With activation checkpointing, what autograd saves outside the recompute regions is
    # the checkpoints (block inputs) and the head's tensors; the option keeps them on the host.
    torch.manual_seed(0)
    base = GPT(gpt_tiny(n_layer=4, checkpointing=True)).to(torch.bfloat16)
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    y = torch.roll(x, -1, 1)
    peaks, weights = {}, {}
    for on_host in (False, True):
        model = copy.deepcopy(base)
        with so.initialize(model, dict(HYPER), cfg(weights="flow", bucket_bytes=16384)) as engine:
            meter = DeviceMeter(model)
            for _ in range(2):
                with meter.track():
                    with engine.weights.activations_on_host() if on_host else nullcontext():
                        loss = model(x, y)
                    engine.backward(loss)
                engine.step()
                engine.zero_grad()
            weights[on_host] = engine.master_weights()
            peaks[on_host] = meter.peak_parts["activations"]
    assert max_diff(weights[False], weights[True]) == 0.0
    assert peaks[True] < peaks[False] / 4, peaks
