"""Offloaded gradients leave the device with their bucket (runtime/departures.py).

* The bound: during backward the device holds at most ``grad_buckets_in_flight + 1``
  offloaded buckets' gradients (measured by ``DeviceMeter``, which counts a gradient tensor
  until it is freed, not only while it is ``p.grad``); after ``backward()`` and ``step()``
  none. ``keep_device_grads=True`` keeps them, as a plain torch loop does.
* The torch contract: an offloaded parameter's ``p.grad`` is None after ``backward()``;
  ``engine.grad_norm()`` and ``engine.full_grad(p)`` read what users read there, checked
  against plain PyTorch; a write to a freed ``p.grad`` is an edit (tests/test_contract.py).
* Accumulation on the device or on the host (``grad_accum_on``) both match AdamW on the
  accumulated gradients, fp32 and bf16, with clipping that rolls speculative steps back.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.runtime.contract import ContractError
from superoffload.runtime.device_meter import DeviceMeter
from superoffload.runtime.devices import CpuDeviceOps
from superoffload.runtime.engine import OffloadEngine

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, LAYERS = 256, 8
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's fp32 gradient: one bucket each


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def mlp_config(**kw: object) -> so.OffloadConfig:
    return cpu_config(**{"ratio": 1.0, "bucket_bytes": LAYER_BYTES, **kw})


def run_metered(config: so.OffloadConfig, *, steps: int = 2):
    """Peak gradient bytes during training, and the gradient bytes left after backward()
    and after step() of the last iteration (the copies have landed: synchronize first)."""
    model = mlp()
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(3))
    with so.initialize(model, dict(HYPER), config) as engine:
        assert all(b.numel == WIDTH * WIDTH + WIDTH for b in engine.bucket_plan.buckets)
        meter = DeviceMeter(model, engine=engine)
        with meter.track():
            for _ in range(steps):
                engine.backward(model(x).square().mean())
                engine.synchronize()
                after_backward = meter.grad_bytes()
                grads_none = [p.grad is None for p in model.parameters()]
                engine.step()
                engine.synchronize()
                after_step = meter.grad_bytes()
                engine.zero_grad()
    return meter.peak_grad_bytes, after_backward, after_step, grads_none


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_device_holds_at_most_the_bound_of_offloaded_buckets(bound):
    """8 layers, one bucket each, every bucket offloaded (the issue's 8-layer MLP: 2.11 MB of
    gradients, all of them resident before). Threads, not inline lanes: the copy really is
    in flight while backward goes on, and backward waits at the bound."""
    peak, after_backward, after_step, grads_none = run_metered(
        mlp_config(grad_buckets_in_flight=bound))
    assert peak <= (bound + 1) * LAYER_BYTES, (peak, bound)
    assert after_backward == 0 and after_step == 0
    assert all(grads_none)  # DeepSpeed ZeRO-2's contract: the gradient left with its bucket


class GatedDeviceOps(CpuDeviceOps):
    """The CPU device ops whose D2H copies wait at a gate: copies stay in flight for as long as
    the test says, with no timing involved."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def d2h(self, grads, dst, ready):
        assert self.gate.wait(timeout=120), "the test never opened the gate"
        return super().d2h(grads, dst, ready)


@pytest.mark.parametrize("bound", [1, 2])
def test_backward_waits_at_the_bound_while_copies_are_stuck(bound):
    """With every D2H copy held at a gate, backward must stop at the bound: the training
    thread blocks waiting for the oldest copy while exactly ``bound`` buckets are in flight
    and at most ``bound + 1`` buckets' gradients are alive; opening the gate lets it finish."""
    model, ops = mlp(), GatedDeviceOps()
    x = torch.randn(16, WIDTH)
    engine = OffloadEngine(model, dict(HYPER), mlp_config(grad_buckets_in_flight=bound),
                           device_ops=ops)
    meter = DeviceMeter(model, engine=engine)
    seen: dict[str, int] = {}
    waiting = threading.Event()
    departures = engine.launcher.departures
    real_wait = departures.wait

    def wait(fut, what, *watchdog):  # the bound's wait: note what is alive, then let the copies run
        if not waiting.is_set():
            seen.update(in_flight=len(departures.in_flight), grads=meter.grad_bytes())
            waiting.set()
        return real_wait(fut, what, *watchdog)

    departures.wait = wait
    opener = threading.Thread(target=lambda: (waiting.wait(timeout=60), ops.gate.set()))
    opener.start()
    try:
        with meter.track():
            engine.backward(model(x).square().mean())
            engine.step()
    finally:
        ops.gate.set()
        opener.join()
        engine.close()
    assert waiting.is_set(), "backward never waited for a copy: the bound was not enforced"
    assert seen["in_flight"] == bound - 1  # the oldest was taken off to be waited for
    assert seen["grads"] <= (bound + 1) * LAYER_BYTES


def test_a_copy_stuck_at_the_bound_is_named_within_the_watchdog():
    """A copy that never lands (the gate stays shut): backward's wait at the bound ends after
    ``watchdog_s`` with a WatchdogTimeout naming the move and the setting that bounds it,
    instead of hanging."""
    from superoffload.runtime.errors import WatchdogTimeout

    model, ops = mlp(), GatedDeviceOps()
    engine = OffloadEngine(model, dict(HYPER), mlp_config(grad_buckets_in_flight=1,
                                                          watchdog_s=0.2), device_ops=ops)
    try:
        with pytest.raises(WatchdogTimeout, match=r"local move of bucket \d+'s gradients "
                           r"\(OffloadConfig.grad_buckets_in_flight\) did not finish within "
                           r"OffloadConfig.watchdog_s=0.2 s"):
            engine.backward(model(torch.randn(16, WIDTH)).square().mean())
    finally:
        ops.gate.set()
        engine.close()


def test_keep_device_grads_keeps_them_as_torch_does():
    peak, after_backward, after_step, grads_none = run_metered(mlp_config(keep_device_grads=True))
    assert peak == after_backward == after_step == LAYERS * LAYER_BYTES
    assert not any(grads_none)


def test_gpu_tail_keeps_its_gradients_until_zero_grad():
    """ratio 0.5: the last-produced half (first layers) is stepped on the device from them."""
    model = mlp()
    x = torch.randn(16, WIDTH)
    with so.initialize(model, dict(HYPER), mlp_config(ratio=0.5)) as engine:
        engine.backward(model(x).square().mean())
        tail = {i for b in engine.bucket_plan.buckets if b.on_device for i in b.param_indices}
        params = list(model.parameters())
        assert tail and len(tail) < len(params)
        assert all((params[i].grad is not None) == (i in tail) for i in range(len(params)))
        engine.step()


# ---------------------------------------------------------------------------- reading grads
def reference_grads(model, data, gas):
    """Plain torch: the accumulated gradients (loss / gas per micro-batch) by name, and
    their total norm."""
    for x, y in data[:gas]:
        (model(x, y) / gas).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, norm


@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("gas", [1, 2])
def test_grad_norm_and_full_grad_match_torch(place, gas):
    data = batches(4)
    want, want_norm = reference_grads(make_model(), data, gas)
    model = make_model()
    cfg = cpu_config(ratio=0.5, grad_accum_steps=gas, grad_accum_on=place, max_grad_norm=0.05)
    with so.initialize(model, dict(HYPER), cfg) as engine:
        for x, y in data[:gas]:
            engine.backward(model(x, y))
        assert engine.grad_norm() == pytest.approx(want_norm, rel=1e-6)
        for name, p in model.named_parameters():  # host buckets and GPU tail ones
            got = engine.full_grad(p)
            assert got is not None and got.dtype == torch.float32
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-7)
        engine.step()  # the norm clips (0.05 < norm): speculative steps roll back and replay
        assert engine.grad_norm() == pytest.approx(want_norm, rel=1e-6)  # the last step's
        assert engine.stats.clipped_steps == 1


def test_full_grad_and_grad_norm_say_when_they_can_be_read():
    model = make_model()
    with so.initialize(model, dict(HYPER), cpu_config(grad_accum_steps=2)) as engine:
        with pytest.raises(ContractError, match="before any backward"):
            engine.grad_norm()
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        with pytest.raises(ContractError, match="still accumulating"):
            engine.full_grad(next(model.parameters()))
        with pytest.raises(ValueError, match="not a trainable parameter"):
            engine.full_grad(torch.nn.Parameter(torch.zeros(2)))


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("gas", [1, 3])
def test_training_matches_adamw_with_gradients_freed(dtype, place, gas):
    """Clipping at a norm most steps exceed: speculative steps are rolled back and replayed
    from the host buffers the freed gradients left in (inverse rollback, the default auto)."""
    data = batches(6 * gas)
    cfg = cpu_config(ratio=0.6, grad_accum_steps=gas, grad_accum_on=place, max_grad_norm=0.3)
    want = train_reference(make_model(dtype=dtype), data, steps=6, gas=gas, max_norm=0.3)
    if place == "host":  # the host buckets sum in fp32; the GPU tail in .grad (bf16 there)
        summed = train_reference(make_model(dtype=dtype), data, steps=6, gas=gas,
                                 max_norm=0.3, sum_fp32=True)
        with so.initialize(make_model(dtype=dtype), dict(HYPER), cfg) as probe:
            host = {probe.state.names[i] for b in probe.bucket_plan.host_buckets
                    for i in b.param_indices}
        want = {n: summed[n] if n in host else w for n, w in want.items()}
    got, stats = train_engine(make_model(dtype=dtype), data, cfg, steps=6)
    assert stats.iterations == 6 and stats.clipped_steps >= 3 and stats.replays >= 1
    # fp32: rollback of the inverse leaves a few ulps; bf16: the weights round to bf16
    assert max_diff(want, got) < (2e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("gas", [2, 3])
def test_kept_gradients_with_host_accumulation_match_plain_accumulation(gas):
    """keep_device_grads=True with grad_accum_on="host": a kept ``.grad`` already holds the
    earlier micro-steps (autograd adds into it), so it leaves once, at the last micro-step.
    ``p.grad``, ``full_grad`` and ``grad_norm`` equal plain accumulation's, and 4 steps with
    clipping match AdamW to 2e-6 (fp32, as above). Counting the earlier micro-steps again
    gave full_grad = 3 g1 + g2 for 2 micro-steps and masters 4e-2 off."""
    data = batches(4 * gas)
    want, want_norm = reference_grads(make_model(), data, gas)
    cfg = cpu_config(ratio=0.6, grad_accum_steps=gas, grad_accum_on="host",
                     keep_device_grads=True, max_grad_norm=0.3)
    model = make_model()
    with so.initialize(model, dict(HYPER), cfg) as engine:
        assert engine.accum_on_host and engine.bucket_plan.host_buckets
        for x, y in data[:gas]:
            engine.backward(model(x, y))
        assert engine.grad_norm() == pytest.approx(want_norm, rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(engine.full_grad(p), want[name], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7)  # kept
        engine.step()
    ref = train_reference(make_model(), data, steps=4, gas=gas, max_norm=0.3)
    got, stats = train_engine(make_model(), data, cfg, steps=4)
    assert stats.iterations == 4 and stats.clipped_steps >= 2
    assert max_diff(ref, got) < 2e-6


@pytest.mark.parametrize("used_in", ["last", "first"])
def test_host_accumulation_is_exact_for_a_parameter_missing_from_a_micro_step(used_in):
    """A parameter with no gradient in the first micro-step starts its host sum in the
    second (a copy, not an add onto last iteration's buffer); one with a gradient in the
    first micro-step only is stepped from its host sum (it has no gradient in the last)."""
    data = batches(8)

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = make_model()
            self.extra = torch.nn.Linear(61, 61)
            self.calls = 0

        def forward(self, x, y):
            loss = self.base(x, y)
            self.calls += 1
            if self.calls % 2 == (0 if used_in == "last" else 1):  # one micro-step of two
                loss = loss + self.extra(torch.ones(61)).square().mean()
            return loss

    def run(engine_cfg):
        torch.manual_seed(0)
        model = Gated()
        if engine_cfg is None:
            params = [p for p in model.parameters()]
            opt = torch.optim.AdamW(params, **HYPER)
            for k in range(0, 8, 2):
                for x, y in data[k:k + 2]:
                    (model(x, y) / 2).backward()
                opt.step()
                opt.zero_grad()
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        with so.initialize(model, dict(HYPER), engine_cfg) as engine:
            for k in range(0, 8, 2):
                for x, y in data[k:k + 2]:
                    engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
            return engine.master_weights()

    want = run(None)
    got = run(cpu_config(ratio=1.0, grad_accum_steps=2, grad_accum_on="host"))
    assert max_diff(want, got) < 2e-6


def test_host_accumulation_refuses_a_grad_transform():
    model = make_model()
    cfg = cpu_config(grad_accum_steps=2, grad_accum_on="host")
    with so.initialize(model, dict(HYPER), cfg) as engine:
        engine.register_grad_transform(lambda name, g: None)
        x, y = batches(1)[0]
        with pytest.raises(ContractError, match="grad_accum_on='device'"):
            engine.backward(model(x, y))


def test_host_accumulation_keeps_the_bound_between_micro_steps():
    """With host accumulation every micro-step's gradients leave: nothing accumulates on the
    device; with device accumulation the full gradients stay until the last micro-step."""
    x = torch.randn(16, WIDTH)
    peaks = {}
    for place in ("host", "device"):
        model = mlp()
        with so.initialize(model, dict(HYPER), mlp_config(grad_accum_steps=4,
                                                          grad_accum_on=place)) as engine:
            meter = DeviceMeter(model, engine=engine)
            with meter.track():
                for _ in range(4):
                    engine.backward(model(x).square().mean())
                engine.step()
                engine.zero_grad()
        peaks[place] = meter.peak_grad_bytes
    assert peaks["host"] <= 3 * LAYER_BYTES
    assert peaks["device"] == LAYERS * LAYER_BYTES
