"""The planner's accuracy machinery (docs/planner.md, "Accuracy"), checked by value, not by
timing: the compute lane's three terms, calibration that keeps their split, repeatable probes
(medians, spreads, the busy-host flag), the model probe, the calibrated flag, and the
calibration that runs by itself after the first iterations of a real run. How accurate the
predictions are on this machine is measured by benchmarks/bench_planner_accuracy.py
(docs/planner.md)."""

from __future__ import annotations

import json

import pytest
import torch

import superoffload as so
from superoffload import plan
from superoffload.plan import compute, timing
from superoffload.plan.autocal import calibrate_run, spread
from superoffload.plan.calibrate import calibration_state
from superoffload.plan.measure import PROFILE_FORMAT
from superoffload.plan.probe import probe_model
from superoffload.telemetry import events as ev

LAPTOP = plan.profiles.get("cpu-laptop")
SHAPE = plan.ModelShape(layers=2, hidden=64, heads=2, vocab=256, seq=32, micro_batch=4,
                        activation_checkpointing=False, dtype="float32")


def test_compute_lane_adds_dispatch_on_a_cpu_and_overlaps_it_on_a_gpu():
    prof = LAPTOP.replace(device_op_s=20e-6, device_nongemm_gbps=10.0)
    fwd, bwd = compute.layer_times(SHAPE, prof)
    block = 1  # a block: matmuls + element-wise bytes + 18 operations, added on the CPU
    flops = SHAPE.layer_forward_flops()[block]
    nbytes = SHAPE.layer_forward_bytes()[block]
    assert nbytes == 4.0 * SHAPE.tokens * (4 * 64 + 6 * 64 + 2 * 64 + 2 * 64 + 2 * 256)
    want = flops / 0.3e12 + nbytes / 10e9 + 18 * 20e-6
    assert fwd[block] == pytest.approx(want)
    assert bwd[block] == pytest.approx(2 * flops / 0.3e12 + 2 * nbytes / 10e9 + 36 * 20e-6)
    # activation checkpointing: a block's backward also runs its forward again, all three
    # terms (3x); the edges (embedding, head) are not recomputed
    _, ckpt_bwd = compute.layer_times(SHAPE.replace(activation_checkpointing=True), prof)
    assert ckpt_bwd[block] == pytest.approx(3 * flops / 0.3e12 + 3 * nbytes / 10e9
                                            + 54 * 20e-6)
    assert ckpt_bwd[0] == pytest.approx(bwd[0]) and ckpt_bwd[-1] == pytest.approx(bwd[-1])
    gpu = prof.replace(device_type="cuda", shared_memory=False)
    gfwd, _ = compute.layer_times(SHAPE, gpu)
    assert gfwd[block] == pytest.approx(max(flops / 0.3e12 + nbytes / 10e9, 18 * 20e-6))
    # presets model neither term: the lane is FLOPs / achieved rate, as before
    plain_fwd, _ = compute.layer_times(SHAPE, LAPTOP)
    assert plain_fwd == pytest.approx([f / 0.3e12 for f in SHAPE.layer_forward_flops()])
    sim = plan.simulate(SHAPE, prof, config=so.presets.tiny_cpu())
    validation = 2 * prof.device_launch_s  # the lane's one other span per iteration
    assert sim.lanes["device_compute"].busy_s == pytest.approx(
        compute.iteration_compute_s(SHAPE, prof) + validation, rel=1e-9)


def test_elementwise_terms_of_gated_and_moe_blocks_by_hand():
    """plan/formulas.py's non-GEMM traffic and operations for a SwiGLU block with GQA and for
    an MoE one (the GPT block is checked above): norms 2 x 2h, residual adds 2 x 3h, flash
    attention 2q + 2kv, gated activation 5f; MoE: k x 5f + 3kh (gather the k copies) + h
    (combine) + 3E (router top-k); operations 18 + 4 gated + 6 per expert."""
    h, q, kv, f = 64, 64, 32, 96  # 2 heads of 32, one key/value head
    gated = SHAPE.replace(gated_mlp=True, ffn_hidden=f, kv_heads=1, bias=False)
    per_token = 4 * h + 6 * h + 2 * q + 2 * kv
    assert gated.layer_forward_bytes()[1] == 4.0 * SHAPE.tokens * (per_token + 5 * f)
    assert gated.layer_forward_ops()[1] == 18 + 4
    moe = gated.replace(experts=4, experts_per_token=2)
    assert moe.layer_forward_bytes()[1] == 4.0 * SHAPE.tokens * (
        per_token + 2 * 5 * f + 3 * 2 * h + h + 3 * 4)
    assert moe.layer_forward_ops()[1] == 18 + 4 + 6 * 4


def test_calibration_scales_the_lane_and_keeps_its_split():
    truth = LAPTOP.replace(device_achieved_tflops=0.05, device_op_s=30e-6,
                           device_nongemm_gbps=5.0)
    guess = LAPTOP.replace(device_achieved_tflops=0.2, device_op_s=10e-6,
                           device_nongemm_gbps=20.0)
    cfg = so.presets.tiny_cpu()
    res = plan.simulate(SHAPE, truth, config=cfg)
    cal = plan.calibrate(guess, res.timeline, SHAPE)
    assert compute.iteration_compute_s(SHAPE, cal) == pytest.approx(
        compute.iteration_compute_s(SHAPE, truth), rel=1e-6)
    g, c = compute.parts(SHAPE, guess), compute.parts(SHAPE, cal)
    assert c.matmul_s / c.dispatch_s == pytest.approx(g.matmul_s / g.dispatch_s)
    assert calibration_state(cal).calibrated and not calibration_state(guess).calibrated
    times = [(it, res.iteration_s) for it in range(1, 4)]
    report = calibrate_run(guess, SHAPE, cfg, res.timeline, times)
    assert report.after_s == pytest.approx(res.iteration_s, rel=0.02)
    assert abs(report.error_before) > 0.5 and abs(report.error_after) < 0.02
    assert "planner calibrated on iterations 1-3" in report.line()
    assert spread([1.0, 1.0, 1.0]) == 0.0 and spread([1.0, 2.0, 3.0]) > 0.5


def test_window_spread_is_p10_to_p90_over_the_median():
    """A calibration window's spread (plan/autocal.py) by hand: one preempted iteration (10x
    slower) moves p90 by a tenth of its excess in a window of 10 (inclusive quantiles: p90 =
    0.9 x 1 + 0.1 x 10), and not at all in a window of 20; min-max would say 9 in both."""
    assert spread([1.0] * 9 + [10.0]) == pytest.approx(0.9, rel=1e-12)
    assert spread([1.0] * 19 + [10.0]) == 0.0
    assert spread([2.0, 1.0, 3.0]) == pytest.approx((2.8 - 1.2) / 2.0, rel=1e-12)


def test_probes_are_medians_with_their_spread():
    ticks = iter([0, 1, 1, 2, 2, 3, 3, 103, 103, 104, 104, 105])  # one call of 100 s
    seconds, spread_ = timing.repeat(lambda: None, 6, clock=lambda: float(next(ticks)))
    assert seconds == 1.0 and spread_ == pytest.approx(99.0)  # the median ignores it
    assert timing.busy_flags({"matmul": 0.02}, load=0.3, cores=2) == ()
    (flag,) = timing.busy_flags({"matmul": 0.25, "link": 0.05}, load=5.0, cores=2)
    assert "load average 5.0 on 2 usable cores" in flag and "matmul 25%" in flag
    assert "link" not in flag
    with pytest.raises(ValueError, match="trials"):
        timing.repeat(lambda: None, 0)


def test_probes_time_after_a_warm_up_and_spread_relative_to_the_median():
    """timing.repeat on a simulated clock that each call advances by its cost: the cold first
    call (0.5 s: page faults, lazy init) is the warm-up, not a trial; the spread is (max - min)
    / median, a fraction, not seconds (exact up to float rounding: rel 1e-9)."""
    now = [0.0]
    costs = iter([0.5, 0.010, 0.012, 0.010, 0.030, 0.011])

    def call() -> None:
        now[0] += next(costs)

    seconds, spread_ = timing.repeat(call, 5, clock=lambda: now[0])
    assert seconds == pytest.approx(0.011, rel=1e-9)
    assert spread_ == pytest.approx((0.030 - 0.010) / 0.011, rel=1e-9)
    assert next(costs, None) is None  # six calls: one warm-up and five trials


def test_measured_profiles_carry_dispatch_spread_and_busy_flag(tmp_path):
    prof = plan.measure_local(quick=True, cache=tmp_path, progress=False)
    raw = prof.extra
    assert raw["format"] == PROFILE_FORMAT == 3
    assert prof.device_op_s > 0 and prof.device_nongemm_gbps == prof.device_mem_bw_gbps
    assert {"host copy", "matmul", "dispatch", "link"} <= set(raw["spread"])
    busy = any(f.startswith("busy host") for f in prof.flags)
    load = raw["load_average"]
    assert busy == (max(raw["spread"].values()) > timing.SPREAD_WARN or (
        load is not None and load > timing.usable_cores()))
    probed = probe_model(SHAPE, prof, trials=3)
    assert probed.device_op_s > 0 and probed.device_nongemm_gbps > 0
    assert probed.is_estimate("device_achieved_tflops") is False
    assert dict(probed.sources)["device_achieved_tflops"].startswith(
        "measured: the model's GEMMs and attention")
    assert set(probed.extra["probe"]["spread"]) == {"gemm", "attention", "elementwise",
                                                    "dispatch"}
    assert not calibration_state(probed).calibrated
    assert plan.simulate(SHAPE, probed).iteration_s > compute.iteration_compute_s(SHAPE, probed)


def test_the_calibration_runs_by_itself_after_the_first_iterations(tmp_path):
    from superoffload.data import BatchSampler, load_tokens
    from superoffload.models.gpt import GPT, gpt_tiny
    from superoffload.runtime.calibrator import AutoCalibrator
    from superoffload.train_loop import TrainSettings, train

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    shape = plan.ModelShape.from_module(model, seq=16, micro_batch=2,
                                        activation_checkpointing=False)
    batches = BatchSampler(load_tokens()[:20000], batch_size=2, seq_len=16, seed=0)
    config = so.presets.tiny_cpu().replace(bucket_bytes=64 * 1024)
    with so.initialize(model, optimizer={"lr": 1e-3}, config=config) as engine:
        cal = AutoCalibrator(engine, shape, LAPTOP, after=4, skip=2, attempts=1,
                             save_to=tmp_path / "profile-calibrated.json")
        seen = []
        cal.on_calibrated(seen.append)
        result = train(engine, model, batches, TrainSettings(steps=8, eval_batches=0,
                                                             warmup_steps=1),
                       calibrator=cal)
        report = result.calibration
        assert report is not None and seen == [report] and cal.error is None
        assert report.iterations == (2, 5)
        spans = [s for s in engine.telemetry.spans() if 2 <= s.iteration <= 5]
        busy = plan.calibrate(LAPTOP, spans, shape).device_achieved_tflops
        assert report.profile.device_achieved_tflops == pytest.approx(busy)
        assert engine.telemetry.notes()[-1].text == report.line()
    saved = plan.HardwareProfile.from_dict(json.loads((tmp_path / "profile-calibrated.json")
                                                      .read_text()))
    assert saved == report.profile and calibration_state(saved).calibrated
    assert saved.name == "cpu-laptop-calibrated"
    spans_kinds = {s.kind for s in spans}
    assert ev.KIND_FORWARD in spans_kinds and ev.KIND_BACKWARD in spans_kinds


def test_a_noisy_window_is_passed_over_for_a_steady_one():
    """A busy host makes a window's iteration times spread: the calibrator measures the next
    window instead (up to `attempts`), on an engine stand-in with chosen times."""
    from superoffload.runtime.calibrator import AutoCalibrator
    from superoffload.telemetry.recorder import Recorder

    class Stub:
        def __init__(self) -> None:
            self.iteration, self.telemetry = 0, Recorder()
            self.config = so.presets.tiny_cpu()
            self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)

        def run(self, seconds: float) -> None:
            t0 = self.iteration * 10.0
            self.telemetry.record(ev.Span(ev.LANE_COMPUTE, ev.KIND_FORWARD, t0, t0 + seconds / 3,
                                          self.iteration))
            self.telemetry.record(ev.Span(ev.LANE_COMPUTE, ev.KIND_BACKWARD, t0 + seconds / 3,
                                          t0 + seconds, self.iteration))
            self.telemetry.scalar("iteration_s", self.iteration, seconds)
            self.iteration += 1
            self.optimizer.step()

    engine = Stub()
    cal = AutoCalibrator(engine, SHAPE, LAPTOP, after=4, skip=1, attempts=3).start()
    for t in [0.01] + [0.01, 0.05, 0.01, 0.08] + [0.02, 0.02, 0.021, 0.02] + [0.02] * 3:
        engine.run(t)
    report = cal.report
    assert report is not None and report.iterations == (5, 8) and report.spread < 0.1
    assert report.measured_s == pytest.approx(0.02)
    assert "busy host" not in report.line()
    # a run that ends before a steady window: the last noisy one, said to be noisy
    engine = Stub()
    cal = AutoCalibrator(engine, SHAPE, LAPTOP, after=4, skip=1, attempts=3).start()
    for t in [0.01] + [0.01, 0.05, 0.01, 0.08] + [0.02, 0.02]:
        engine.run(t)
    assert cal.report is None
    cal.stop()
    assert cal.report is not None and cal.report.iterations == (1, 4)
    assert "busy host" in cal.report.line()
