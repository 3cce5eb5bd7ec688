"""Cost-model formulas against hand-worked cases (plan/cost.py docstring)."""

from __future__ import annotations

import pytest

from superoffload import plan
from superoffload.plan import cost

GH200 = plan.profiles.get("gh200")
MiB = 1 << 20


def test_link_time_latency_plus_bytes_over_peak() -> None:
    # 64 MiB over C2C: 20 us + 67108864 B / 375e9 B/s (the measured rate) = 198.96 us
    t = cost.link_time_s(64 * MiB, GH200, "h2d")
    assert t == pytest.approx(20e-6 + 67108864 / 375e9, rel=1e-12)
    assert cost.link_gbps(64 * MiB, GH200, "h2d") == pytest.approx(67108864 / t / 1e9)
    assert cost.link_time_s(64 * MiB, GH200, "d2h") == pytest.approx(20e-6 + 67108864 / 297e9)
    assert cost.link_time_s(0, GH200, "h2d") == 0.0


def test_link_table_is_log_interpolated() -> None:
    prof = GH200.replace(h2d_table=((1e6, 10.0), (1e8, 20.0)))
    # 1e7 is halfway in log between 1e6 and 1e8: 15 GB/s
    assert cost.link_time_s(1e7, prof, "h2d") == pytest.approx(1e7 / 15e9)
    assert cost.link_time_s(1e9, prof, "h2d") == pytest.approx(1e9 / 20e9)  # clamped
    assert cost.link_time_s(1e7, prof, "d2h") == pytest.approx(20e-6 + 1e7 / 297e9)  # no table


def test_cpu_adam_reproduces_the_grace_figures() -> None:
    # FACTS.md, 1B params on Grace: GraceAdam 0.082 s, DeepSpeed 0.098 s, PyTorch 0.289 s
    for kernel, seconds in (("ours", 0.082), ("deepspeed", 0.098), ("torch", 0.289)):
        t = cost.cpu_adam_time_s(1e9, GH200, 72, kernel)  # type: ignore[arg-type]
        assert t == pytest.approx(seconds + GH200.cpu_call_s, rel=1e-9)


def test_cpu_adam_bandwidth_cap_and_table() -> None:
    pcie = plan.profiles.get("h100-pcie")
    # 32 cores x 0.8 G/s = 25.6 G/s, capped at 0.8 x 250 GB/s / 28 B = 7.14 G params/s
    assert cost.cpu_adam_rate(pcie, 32) == pytest.approx(0.8 * 250e9 / 28)
    assert cost.cpu_adam_rate(pcie, 2) == pytest.approx(1.6e9)
    measured = pcie.replace(cpu_adam_table=((1, 1e9), (4, 2.5e9)))
    assert cost.cpu_adam_rate(measured, 2) == pytest.approx(1.5e9)  # linear between points
    assert cost.cpu_adam_rate(measured, 16) == pytest.approx(2.5e9)  # saturated
    # fewer bytes per param (bf16 grads read in the kernel's pass) cost proportionally less
    full = cost.cpu_adam_time_s(1e8, pcie, 4) - pcie.cpu_call_s
    assert cost.cpu_adam_time_s(1e8, pcie, 4, bytes_per_param=26) - pcie.cpu_call_s == (
        pytest.approx(full * 26 / 28))
    with pytest.raises(ValueError, match="kernel"):
        cost.cpu_adam_rate(pcie, 4, "fortran")  # type: ignore[arg-type]


def test_device_adam_compute_and_casts() -> None:
    # 1e9 params x 28 B over 4 TB/s + 10 us launch
    assert cost.device_adam_time_s(1e9, GH200) == pytest.approx(10e-6 + 28e9 / 4e12)
    assert cost.compute_time_s(660e12, GH200) == pytest.approx(1.0)
    assert cost.device_cast_time_s(1e9, GH200) == pytest.approx(
        10e-6 + 1e9 / (4000 * 0.7 / 6 * 1e9))
    assert cost.host_cast_time_s(1e9, GH200) == pytest.approx(1e9 / 50e9)


def test_threads_from_config() -> None:
    assert cost.cpu_threads(GH200, None, 0.9) == 64  # floor(0.9 * 72)
    assert cost.cpu_threads(GH200, 8, 0.9) == 8
    assert cost.cpu_threads(GH200, 500, 0.9) == 72
    assert cost.cpu_threads(plan.profiles.get("cpu-laptop"), None, 0.01) == 1


def test_casting_choice_follows_the_bottleneck() -> None:
    slow_link = GH200.replace(h2d_gbps=0.001, d2h_gbps=0.001)
    g, p, _ = cost.choose_casting(slow_link, "ours", 72, 16 * MiB)
    assert (g, p) == ("host", "host")  # fewest bytes over a crawling link
    fast_link = GH200.replace(h2d_gbps=1e6, d2h_gbps=1e6, link_latency_s=0.0)
    g, p, why = cost.choose_casting(fast_link, "torch", 72, 16 * MiB)
    assert (g, p) == ("device", "device")  # no fused casts: keep the CPU to the Adam pass only
    assert "ps/param" in why
    # with our fused kernel on GH200: grads read as bf16 in the pass, weights cast on the GPU
    assert cost.choose_casting(GH200, "ours", 64, 16 * MiB)[:2] == ("host", "device")


def test_weight_flow_efficiency_by_hand() -> None:
    shape = plan.ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq=8, micro_batch=2)
    prof = GH200.replace(device_achieved_tflops=1e-6, device_peak_tflops=1e-6, h2d_gbps=1e-3,
                         link_latency_s=0.0)
    # 1 MFLOP/s and 1 MB/s: compute = 13.672448 s; only the embedding's fetch (2 x 6400 B =
    # 12.8 ms, twice) is exposed, because it has no compute to hide behind
    compute = 13.672448
    exposed = 2 * 0.0128
    assert cost.weight_flow_efficiency(shape, prof) == pytest.approx(compute / (compute + exposed))
    instant_link = prof.replace(h2d_gbps=1e9)
    assert cost.weight_flow_efficiency(shape, instant_link) == pytest.approx(1.0, abs=1e-9)
