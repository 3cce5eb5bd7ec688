"""measure_local (quick variant, cached) and calibrate: round trip on simulated spans, and the
engine's own measured timeline on this machine predicted for a different model size."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from superoffload import plan
from superoffload.config import OffloadConfig
from superoffload.plan.calibrate import fit_latency_rate
from superoffload.plan.measure import PROFILE_FORMAT, _adam_flags, cached_profile

GH200 = plan.profiles.get("gh200")


def test_measure_local_quick_is_cached(tmp_path) -> None:
    prof = plan.measure_local(quick=True, cache=tmp_path, progress=False)
    assert prof.validate() is prof
    assert prof.cpu_adam_table and prof.h2d_table and prof.d2h_table
    assert prof.shared_memory == (not torch.cuda.is_available())
    assert prof.cpu_cores >= 1 and prof.host_memory_bytes > 1e8
    files = list(tmp_path.glob("profile-*-quick.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    again = plan.measure_local(quick=True, cache=tmp_path, progress=False)
    assert again == prof and files[0].stat().st_mtime_ns == stamp  # read back, not re-measured
    assert cached_profile(quick=True, cache=tmp_path) == prof  # the never-measuring reader
    assert cached_profile(quick=False, cache=tmp_path) is None
    files[0].write_text("{not json")
    fresh = plan.measure_local(quick=True, cache=tmp_path, progress=False)  # corrupt: re-measure
    assert fresh.validate() and json.loads(files[0].read_text())["name"] == fresh.name
    # a profile of the old format (warm-buffer Adam, copy counted 2 B per byte): re-measured
    stale = json.loads(files[0].read_text())
    stale["extra"]["format"] = 1
    files[0].write_text(json.dumps(stale))
    measured = plan.measure_local(quick=True, cache=tmp_path, progress=False)
    assert measured.extra["format"] == PROFILE_FORMAT
    # what the rule book needs: is the device the CPU itself; the engine's thread count measured
    assert prof.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    from superoffload.threads import optimizer_threads, runtime_threads, usable_cores

    engine = optimizer_threads(usable_cores(), 0.9, reserved=runtime_threads(prof.device_type))
    assert engine in dict(prof.cpu_adam_table)
    assert all(len(v) >= 2 for v in prof.extra["adam_samples_s"].values())  # median of calls
    # a measured profile drives the simulator like any preset
    shape = plan.ModelShape(layers=2, hidden=128, heads=4, vocab=256, seq=64, micro_batch=4)
    assert plan.simulate(shape, prof).iteration_s > 0


def test_adam_rate_above_the_bus_is_flagged_not_clamped() -> None:
    # FACTS.md H200: 8.4 G params/s on a warm buffer x 30 B (engine variant + write-allocate)
    # = 252 GB/s, against a bus of 71 x 1.5 = 106.5 GB/s: cache, flagged
    (flag,) = _adam_flags(8.4e9, 106.5, True)
    assert "8.40 G params/s" in flag and "252 GB/s" in flag and "106 GB/s" in flag
    # the engine's 3.1 G/s is 93 GB/s: DRAM speed, consistent, nothing to say
    assert _adam_flags(3.1e9, 106.5, True) == ()
    # without write-allocate the same pass is 28 B: 3.9 G/s x 28 = 109 GB/s is within 10%
    assert _adam_flags(3.9e9, 106.5, False) == ()


def test_fit_latency_rate_by_hand() -> None:
    samples = [(1e6, 1e-5 + 1e6 / 1e9), (2e6, 1e-5 + 2e6 / 1e9), (4e6, 1e-5 + 4e6 / 1e9),
               (4e6, 1e-5 + 4e6 / 1e9), (4e6, 1.0)]  # an outlier: each size's median is used
    lat, rate = fit_latency_rate(samples)
    assert lat == pytest.approx(1e-5, rel=1e-6) and rate == pytest.approx(1e9, rel=1e-6)
    assert fit_latency_rate([(1e6, 2e-3), (1e6, 1e-3), (1e6, 1.5e-3)]) == (
        0.0, pytest.approx(2/3 * 1e9))
    with pytest.raises(ValueError):
        fit_latency_rate([])


def test_calibrate_recovers_the_rates_of_simulated_spans() -> None:
    truth = GH200.replace(device_achieved_tflops=400.0, h2d_gbps=300.0, d2h_gbps=200.0,
                          cpu_call_s=50e-6, link_latency_s=15e-6)
    shape = plan.ModelShape(layers=6, hidden=2048, heads=16, vocab=50257, seq=2048)
    cfg = OffloadConfig(bucket_bytes=16 << 20, cpu_threads=64)
    res = plan.simulate(shape, truth, config=cfg)
    cal = plan.calibrate(GH200, res.timeline, shape, cpu_threads=64,
                         adam_bytes_per_param=_adam_bytes(res))
    # forward + backward busy time per iteration is exactly executed FLOPs / rate
    assert cal.device_achieved_tflops == pytest.approx(400.0, rel=1e-6)
    assert cal.h2d_gbps == pytest.approx(300.0, rel=1e-3)
    assert cal.d2h_gbps == pytest.approx(200.0, rel=1e-3)
    # the fitted CPU rate is the lane's (host bus shared with the DMA included): the lane's
    # per-parameter time under the truth, for the pass the spans came from
    step = plan.cost.host_step(truth, res.plan.grad_cast, res.plan.param_cast, "ours")
    lane = float(plan.cost.host_step_s(1.0, truth, 64, "ours", step))
    assert float(plan.cost.host_step_s(1.0, cal, 64, "ours", step)) == pytest.approx(lane, rel=1e-3)
    assert cal.cpu_call_s == pytest.approx(50e-6, rel=1e-3)
    # the unfused tail step moves 118 B/param: the device bandwidth comes back
    assert cal.device_mem_bw_gbps == pytest.approx(truth.device_mem_bw_gbps, rel=1e-3)
    assert cal.name == "gh200-calibrated"
    again = plan.simulate(shape, cal, config=cfg)
    assert again.iteration_s == pytest.approx(res.iteration_s, rel=0.01)


def _adam_bytes(res: plan.SimResult) -> float:
    """Bytes per parameter the simulated CPU pass touched (our kernel fuses the chosen casts)."""
    return plan.cost.host_step(GH200, res.plan.grad_cast, res.plan.param_cast, "ours").kernel_bytes


# --------------------------------------------------------------------------- the engine
class _EngineRun:
    """A tiny GPT trained by the real engine on this machine's CPU backend."""

    def __init__(self, n_layer: int, n_embd: int, cfg: OffloadConfig) -> None:
        import superoffload as so
        from superoffload.models.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        seq, mb = 64, 4
        self.model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=seq))
        self.engine = so.initialize(self.model, optimizer={"lr": 1e-3}, config=cfg)
        self.x = torch.randint(0, 256, (mb, seq))
        self.y = torch.randint(0, 256, (mb, seq))
        self.times: list[float] = []
        self.shape = plan.ModelShape.from_module(self.model, seq=seq, micro_batch=mb,
                                                 activation_checkpointing=False)

    def block(self, iters: int) -> None:
        """`iters` iterations; the first one's time (it follows the other model's block) is
        dropped, the rest are step-to-step times of a running pipeline."""
        for i in range(iters):
            loss = self.model(self.x, self.y)
            self.engine.backward(loss)
            self.engine.step()
            self.engine.zero_grad()
            if i:
                self.times.append(self.engine.telemetry.scalars("iteration_s")[-1].value)

    def close(self) -> list:
        self.engine.synchronize()
        spans = self.engine.telemetry.spans()
        self.engine.close()
        return spans


# Stated error: this 2-core machine is shared with other jobs, the engine's compute and its
# CPU optimizer contend for the same cores, and small matmuls run below the rate of larger
# ones. The two sizes run interleaved (blocks of iterations) so they see the same load, and
# medians are compared. Typical errors measured here: the fitted size within +-15%, the other
# size +30% (a systematic over-prediction: the compute rate is fitted at the smaller width,
# where matmuls run less efficiently). Held to +-25% and +-60%; errors are printed.
CROSS_SIZE_ERROR = 0.6
SELF_ERROR = 0.25


# Timing on a shared 2-core machine: another process taking a core for a second skews one
# model's median. One rerun separates that from a real regression of the model (which fails
# both times); the errors of each attempt are printed.
@pytest.mark.flaky(reruns=1)
def test_calibrated_simulator_predicts_the_engine_on_another_size() -> None:
    cfg = OffloadConfig(device="cpu", bucket_bytes=1 << 20, ratio=0.9)
    small, large = _EngineRun(2, 128, cfg), _EngineRun(3, 192, cfg)
    try:
        small.block(3)
        large.block(2)  # warm-up blocks (allocation, thread start)
        small.times.clear()
        large.times.clear()
        for _ in range(3):
            small.block(4)
            large.block(4)
    finally:
        small_spans, _ = small.close(), large.close()
    # the cores this process may run on (Linux), else all of them
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    base = plan.profiles.get("cpu-laptop").replace(cpu_cores=cores)  # rates are fitted below
    threads = plan.cost.cpu_threads(base, cfg.cpu_threads, cfg.cpu_cores_frac)
    cal = plan.calibrate(base, small_spans, small.shape, cpu_threads=threads)
    # the engine moves fp32 both ways (an fp32 model): the simulator's "device" cast sides
    sim_cfg = cfg.replace(grad_cast="device", param_cast="device")
    tech = plan.Techniques(rollback_rate=0.0)
    measured_small = statistics.median(small.times)
    measured_large = statistics.median(large.times)
    self_pred = plan.simulate(small.shape, cal, config=sim_cfg, techniques=tech).iteration_s
    cross_pred = plan.simulate(large.shape, cal, config=sim_cfg, techniques=tech).iteration_s
    self_err = self_pred / measured_small - 1
    cross_err = cross_pred / measured_large - 1
    print(f"calibration: self {self_pred * 1e3:.1f} vs {measured_small * 1e3:.1f} ms "
          f"({self_err:+.1%}); other size {cross_pred * 1e3:.1f} vs {measured_large * 1e3:.1f} ms "
          f"({cross_err:+.1%})")
    assert abs(self_err) <= SELF_ERROR
    assert abs(cross_err) <= CROSS_SIZE_ERROR
