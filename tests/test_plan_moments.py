"""bf16 Adam moments in the planner (OffloadConfig.optimizer_state_dtype): the host lane's bytes
and compute by hand, host memory per rank, the simulated CPU step, and the tuner, which proposes
them only when allowed, only when they pay, and says so."""

from __future__ import annotations

import pytest

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.plan import cost
from superoffload.plan.memory import offloaded_params
from superoffload.telemetry import events as ev

GH200 = plan.profiles.get("gh200")
PCIE = plan.profiles.get("h100-pcie")
H200 = plan.profiles.get("h200-pcie-measured")
REL = 1.3 / 3.0  # docs/kernel.md: bf16-moment pass ~1.3 vs fp32 ~3 G params/s per thread
SMALL = plan.ModelShape(layers=8, hidden=2048, heads=16, vocab=50257, seq=512, micro_batch=1)
BF16 = OffloadConfig(optimizer_state_dtype="bf16")


def test_host_step_bytes_by_hand() -> None:
    # x86 (write-allocate), gradients and weights cross as bf16: the pass reads a bf16 grad
    # (-2) and writes the bf16 copy (+2): 28 B, + 2 B allocate read of the copy, + 2 + 2 B
    # of DMA = 34 B on the bus; bf16 moments read and write m and v as 2 B: 8 B fewer
    fp32 = cost.host_step(PCIE, "host", "host", "ours")
    bf16 = cost.host_step(PCIE, "host", "host", "ours", moments="bf16")
    assert (fp32.kernel_bytes, fp32.bus_bytes, fp32.compute_scale) == (28, 34, 1.0)
    assert (bf16.kernel_bytes, bf16.bus_bytes) == (20, 26)
    assert bf16.compute_scale == pytest.approx(1 / REL)  # the same pass, slower per param
    assert PCIE.cpu_adam_bf16_moments_relative == pytest.approx(REL)
    # Grace (no write-allocate), fp32 weights back: 26 B pass + 4 + 2 B of DMA; bf16: 18 + 6
    g = cost.host_step(GH200, "host", "device", "ours", moments="bf16")
    assert (g.kernel_bytes, g.bus_bytes) == (18, 24)
    assert g.compute_scale == pytest.approx(26 / 28 / REL)
    with pytest.raises(ValueError, match="optimizer_state_dtype='fp16'"):
        cost.host_step(PCIE, "host", "host", "ours", moments="fp16")


def test_bf16_moments_pay_where_the_bus_binds_not_where_the_cores_do() -> None:
    # h100-pcie, 30 threads x 0.8 G/s = 24 G params/s of compute, bus 0.8 x 250 GB/s:
    # fp32 max(1/24e9, 34/200e9) = 170 ps/param; bf16 max(1/(24e9 x REL), 26/200e9) = 130
    t32 = cost.host_step_s(1.0, PCIE, 30, "ours", cost.host_step(PCIE, "host", "host", "ours"))
    t16 = cost.host_step_s(1.0, PCIE, 30, "ours",
                           cost.host_step(PCIE, "host", "host", "ours", moments="bf16"))
    assert float(t32) == pytest.approx(34 / 200e9)
    assert float(t16) == pytest.approx(26 / 200e9)  # 1.31x: the bus bound, 34 / 26
    # FACTS.md's H200 host at the engine's 14 threads: compute 3.3 + 6/8 x 5.1 = 7.125 G/s
    # (the warm table), bus 106.5 GB/s. fp32 is bus-bound at 34 / 106.5e9 = 319 ps; bf16 is
    # compute-bound at 1 / (7.125e9 x REL) = 324 ps: no gain (1.5% slower)
    h32 = cost.host_step_s(1.0, H200, 14, "ours", cost.host_step(H200, "host", "host", "ours"))
    h16 = cost.host_step_s(1.0, H200, 14, "ours",
                           cost.host_step(H200, "host", "host", "ours", moments="bf16"))
    assert float(h32) == pytest.approx(34 / 106.5e9)
    assert float(h16) == pytest.approx(1 / (7.125e9 * REL))
    assert h16 > h32


def test_simulated_cpu_step_uses_the_bf16_pass() -> None:
    cfg = BF16.replace(ratio=1.0, grad_cast="host", param_cast="host")
    r = plan.simulate(SMALL, PCIE, config=cfg)
    assert r.plan.optimizer_state_dtype == "bf16"
    assert r.summary()["plan"]["optimizer_state_dtype"] == "bf16"
    threads = r.plan.threads
    per_param = max(1 / (threads * 0.8e9 * REL), 26 / (0.8 * 250e9))
    it = r.timeline[-1].iteration
    steps = [s for s in r.timeline if s.kind == ev.KIND_CPU_STEP and s.iteration == it]
    numel = {b.id: b.numel for b in r.plan.bucket_plan.host_buckets}
    for s in steps:
        assert s.duration_s == pytest.approx(PCIE.cpu_call_s + numel[s.bucket] * per_param)
    fp32 = plan.simulate(SMALL, PCIE, config=cfg.replace(optimizer_state_dtype="fp32"))
    assert r.iteration_s < fp32.iteration_s
    # plain PyTorch keeps fp32 moments on the device whatever the config says
    assert plan.simulate(SMALL, PCIE, "gpu", BF16).plan.optimizer_state_dtype == "fp32"


@pytest.mark.parametrize("dp", [1, 4])
def test_host_memory_is_4_bytes_per_param_less(dp: int) -> None:
    cfg = OffloadConfig(ratio=0.9, rollback="snapshot", speculation="on")
    shape = SMALL.replace(dp=dp)
    a = plan.simulate(shape, GH200, config=cfg)
    b = plan.simulate(shape, GH200, config=cfg.replace(optimizer_state_dtype="bf16"))
    off = offloaded_params(shape, a.plan) / dp  # this rank's shard
    ha, hb = a.memory_detail.host_parts, b.memory_detail.host_parts
    assert ha["resident_state"] == pytest.approx(12 * off, rel=1e-4)  # master, m, v in fp32
    assert hb["resident_state"] == pytest.approx(8 * off, rel=1e-4)  # m and v 2 B each
    assert ha["grad_buffers"] == hb["grad_buffers"]  # the gradient buffer does not change
    assert ha["rollback_snapshot"] == pytest.approx(12 * off, rel=1e-4)  # p, m, v in fp32
    assert hb["rollback_snapshot"] == pytest.approx(8 * off, rel=1e-4)  # p fp32, m, v bf16
    # 4 state + 4 snapshot
    assert a.memory["host"] - b.memory["host"] == pytest.approx(8 * off, rel=1e-4)
    assert a.memory["device"] == b.memory["device"]  # the GPU tail keeps fp32 moments


def _tune(**cons: object) -> tuple[OffloadConfig, str, plan.SimResult]:
    # a 0.5B model on an H100 PCIe capped at 6 GB: most state offloaded, the host bus binds
    return plan.tune(SMALL, PCIE, plan.Constraints(device_memory_bytes=6e9, **cons))


def test_tuner_never_proposes_bf16_moments_unasked() -> None:
    cfg, why, pred = _tune()
    assert cfg.optimizer_state_dtype == "fp32" and pred.plan.optimizer_state_dtype == "fp32"
    assert cfg.extra["planner"]["numerics_changes"] == []
    # they would pay here, so the explanation says so and how to allow them
    line = next(x for x in why.splitlines() if x.startswith("- optimizer_state_dtype"))
    assert "bf16 moments would take" in line and "--allow-bf16-moments" in line


def test_tuner_proposes_bf16_moments_when_allowed_and_they_pay() -> None:
    base_cfg, _, base = _tune()
    cfg, why, pred = _tune(allow_bf16_moments=True)
    assert cfg.optimizer_state_dtype == "bf16"
    assert pred.iteration_s < base.iteration_s * (1 - 0.02)  # tune.BF16_MIN_GAIN
    again = plan.simulate(SMALL, PCIE.replace(device_memory_bytes=6e9), config=cfg)
    assert again.iteration_s == pytest.approx(pred.iteration_s)
    assert "CHANGES THE NUMERICS" in why and "docs/kernel.md" in why
    assert f"{base.iteration_s * 1e3:.1f} ms with fp32 moments" in why
    assert cfg.extra["planner"]["numerics_changes"] == ["optimizer_state_dtype='bf16'"]


def test_tuner_keeps_fp32_moments_when_bf16_does_not_pay() -> None:
    # FACTS.md's H200 host: the bf16 pass is compute-bound at about the fp32 pass's bus time
    cons = plan.Constraints(rollback_rate=0.0, allow_bf16_moments=True,
                            fixed={"ratio": 0.7, "device": "cuda"})
    cfg, why, _ = plan.tune(plan.facts.H200_SHAPE, H200, cons)
    assert cfg.optimizer_state_dtype == "fp32"
    assert "bf16 moments were allowed and weighed" in why
    assert "less than the 2% a change of numerics must gain" in why


def test_bf16_moments_when_only_they_fit_and_the_hint_when_not_allowed() -> None:
    # ratio 1 with weight-flow (both casts on the host) needs 12 + 2 + 2 B/param of host
    # memory with fp32 moments (master, m, v; the bf16 gradient buffer; the bf16 copy the
    # blocks stream from), 8 + 2 + 2 with bf16: 8.1 GB and 6.1 GB for 0.506B params; 8 GB of
    # host leaves 7.2 usable. A 3 GB device holds too little for a lower ratio to help (the
    # search walks it down; 4 GB did before the device kept only the gradients in flight)
    prof = PCIE.replace(host_memory_bytes=8e9, device_memory_bytes=3e9)
    with pytest.raises(plan.InfeasibleError, match="bf16 moments would fit") as exc:
        plan.tune(SMALL, prof)
    assert "--allow-bf16-moments" in str(exc.value)
    cfg, why, pred = plan.tune(SMALL, prof, plan.Constraints(allow_bf16_moments=True))
    assert cfg.optimizer_state_dtype == "bf16" and pred.fits
    assert "fp32 moments do not fit" in why and "CHANGES THE NUMERICS" in why


def test_a_fixed_state_dtype_wins_over_the_flag() -> None:
    cfg, why, _ = _tune(fixed={"optimizer_state_dtype": "bf16"})
    assert cfg.optimizer_state_dtype == "bf16"
    assert "- optimizer_state_dtype = 'bf16': fixed by the constraints." in why
    cfg, _, _ = _tune(allow_bf16_moments=True, fixed={"optimizer_state_dtype": "fp32"})
    assert cfg.optimizer_state_dtype == "fp32"
