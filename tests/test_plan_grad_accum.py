"""Where offloaded gradients accumulate (plan/grad_accum.py): the decision, its boundary, and
the predictions that follow it (the rule book carries the place; the simulator times it)."""

from __future__ import annotations

import pytest

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.plan import compute
from superoffload.plan.grad_accum import choose_grad_accum
from superoffload.plan.memory import DEVICE_HEADROOM
from superoffload.plan.schedule import ScheduleFacts, resolve_schedule

PCIE = plan.profiles.get("h100-pcie")
SHAPE = plan.ModelShape(layers=8, hidden=2048, heads=16, vocab=50257, seq=512)
"""0.5 B params at seq 512: the link (55 GB/s) is slower than the compute of a micro-step."""
ACCUM = OffloadConfig(grad_accum_steps=4)


def test_one_micro_step_or_one_memory_pool_accumulates_on_the_device() -> None:
    one = choose_grad_accum(SHAPE, PCIE, OffloadConfig())
    assert one.place == "device" and "nothing accumulates" in one.reason
    assert one.device_accumulation_s is None  # nothing was compared
    for name in ("cpu-laptop", "mi300a"):  # the CPU backend; an APU's single pool
        pool = choose_grad_accum(SHAPE, plan.profiles.get(name), ACCUM)
        assert pool.place == "device" and "saves no memory" in pool.reason, name


def test_both_fit_the_device_is_faster() -> None:
    choice = choose_grad_accum(SHAPE, PCIE, ACCUM)
    assert choice.place == "device" and "both fit" in choice.reason
    # three accumulating micro-steps: forward + backward each on the device; on the host each
    # also sends every offloaded gradient over the link, which is the slower lane here
    fwd, bwd = compute.layer_times(SHAPE, PCIE)
    assert choice.device_accumulation_s == pytest.approx(3 * (sum(fwd) + sum(bwd)))
    assert choice.host_accumulation_s > 3 * SHAPE.params * 2 / 55e9
    # accumulating on the device keeps every offloaded gradient resident: more device memory
    assert choice.device_accum_device_bytes > choice.host_accum_device_bytes
    assert f"{choice.host_accumulation_s * 1e3:.4g} ms" in choice.reason


def test_the_host_when_device_accumulation_does_not_fit_and_the_boundary() -> None:
    need = choose_grad_accum(SHAPE, PCIE, ACCUM).device_accum_device_bytes
    assert need is not None
    at = PCIE.replace(device_memory_bytes=need / DEVICE_HEADROOM)  # exactly fits
    assert choose_grad_accum(SHAPE, at, ACCUM).place == "device"
    below = PCIE.replace(device_memory_bytes=need / DEVICE_HEADROOM * (1 - 1e-9))
    choice = choose_grad_accum(SHAPE, below, ACCUM)
    assert choice.place == "host"
    assert "accumulating on the device does not fit" in choice.reason
    assert "3.18 GB device memory" in choice.reason  # the numbers, readable at this size
    # nothing fits: the host, which needs the least device memory
    tiny = PCIE.replace(device_memory_bytes=1e9)
    assert choose_grad_accum(SHAPE, tiny, ACCUM).place == "host"
    assert "neither fits" in choose_grad_accum(SHAPE, tiny, ACCUM).reason


def test_predictions_describe_the_place_that_runs() -> None:
    need = choose_grad_accum(SHAPE, PCIE, ACCUM).device_accum_device_bytes
    assert need is not None
    small = PCIE.replace(device_memory_bytes=need / DEVICE_HEADROOM * 0.99)
    auto = plan.simulate(SHAPE, small, config=ACCUM)  # grad_accum_on="auto"
    host = plan.simulate(SHAPE, small, config=ACCUM.replace(grad_accum_on="host"))
    dev = plan.simulate(SHAPE, small, config=ACCUM.replace(grad_accum_on="device"))
    assert auto.plan.grad_accum_on == "host" and auto.fits and not dev.fits
    assert any(r.startswith("grad_accum_on=host") for r in auto.plan.reasons)
    assert auto.memory == host.memory and auto.optimizer_step_s == host.optimizer_step_s
    # one optimizer step = the micro-step that steps + three that only accumulate
    assert host.optimizer_step_s == pytest.approx(host.iteration_s + host.accumulation_s)
    assert host.accumulation_s > dev.accumulation_s > 0
    assert host.summary()["optimizer_step_s"] == host.optimizer_step_s
    # without accumulation there is nothing to add
    assert plan.simulate(SHAPE, PCIE).accumulation_s == 0.0
    # the memory search and the capacity check decide "auto" the same way
    assert plan.fit_problems(SHAPE, small, "superoffload", ACCUM) == []
    assert plan.fit_problems(SHAPE, small, "superoffload", ACCUM.replace(grad_accum_on="device"))


def test_the_rule_book_carries_the_place() -> None:
    facts = ScheduleFacts(params=SHAPE.param_specs(), device_type="cuda", profile=PCIE)
    assert resolve_schedule(ACCUM.replace(grad_accum_on="host"), facts).grad_accum_on == "host"
    assert resolve_schedule(ACCUM, facts, grad_accum="host").grad_accum_on == "host"
    undecided = resolve_schedule(ACCUM, facts)
    assert undecided.grad_accum_on == "device" and any("not decided" in n for n in undecided.notes)
    cpu = ScheduleFacts(params=SHAPE.param_specs(), device_type="cpu")
    assert resolve_schedule(ACCUM, cpu).notes == ()  # the CPU rule's own answer
    assert resolve_schedule(OffloadConfig(), facts).grad_accum_on == "device"
    with pytest.raises(ValueError, match="grad_accum"):
        resolve_schedule(ACCUM, facts, grad_accum="auto")


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="ModelShape"):
        choose_grad_accum("gpt", PCIE, ACCUM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HardwareProfile"):
        choose_grad_accum(SHAPE, "h100-pcie", ACCUM)  # type: ignore[arg-type]
