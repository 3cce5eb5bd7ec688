"""The main job: the training loop (against a plain-PyTorch stand-in and the real engine)
and `python -m superoffload train --json`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import superoffload as so
from superoffload.data import BatchSampler, load_tokens
from superoffload.models import GPT, gpt_tiny
from superoffload.telemetry import Recorder
from superoffload.train_loop import (
    Progress,
    StepInfo,
    TrainSettings,
    lr_factor,
    make_scheduler,
    train,
)

ROOT = Path(__file__).resolve().parents[1]


class PlainEngine:
    """Stand-in with the engine's contract: torch AdamW, no offload, no telemetry spans."""

    def __init__(self, model: torch.nn.Module, **hyper: float) -> None:
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), **hyper)  # type: ignore[arg-type]
        self.telemetry = Recorder()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def synchronize(self) -> None:
        pass


def _sampler(seed: int = 0) -> BatchSampler:
    return BatchSampler(load_tokens()[:200_000], batch_size=2, seq_len=16, seed=seed)


def test_lr_schedule_by_hand() -> None:
    def f(step: int) -> float:
        return lr_factor(step, steps=11, warmup_steps=2, min_lr_frac=0.1)

    assert f(0) == 0.5 and f(1) == 1.0  # linear warm-up
    assert f(2) == pytest.approx(1.0)  # cosine starts at the top
    # the cosine spans steps 2..10; halfway (step 6): 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert f(6) == pytest.approx(0.55)
    assert f(10) == pytest.approx(0.1)  # ends at min_lr_frac


def test_loop_matches_a_hand_written_adamw_loop() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    ref = GPT(gpt_tiny())
    ref.load_state_dict(model.state_dict())
    settings = TrainSettings(steps=6, warmup_steps=2, eval_batches=0, final_window=2)
    seen: list[StepInfo] = []
    result = train(PlainEngine(model, lr=1e-3), model, _sampler(), settings, on_step=seen.append)

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = _sampler()
    expected = []
    for step in range(6):
        for g in opt.param_groups:
            g["lr"] = 1e-3 * lr_factor(step, steps=6, warmup_steps=2, min_lr_frac=0.1)
        x, y = batches.next_batch()
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    # same ops in the same order on the same data: equal up to float reassociation
    assert result.losses == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert result.lrs == pytest.approx([1e-3 * lr_factor(s, steps=6, warmup_steps=2,
                                                         min_lr_frac=0.1) for s in range(6)])
    assert result.first_loss == expected[0]
    assert result.final_loss == pytest.approx(sum(expected[-2:]) / 2)
    assert result.tokens == 6 * 2 * 16 and result.tokens_per_s > 0
    assert [s.step for s in seen] == [1, 2, 3, 4, 5, 6]
    assert result.summary is None and math.isnan(seen[-1].overlap)  # the stand-in records no spans


def test_loop_with_the_engine_matches_the_stand_in() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    ref = GPT(gpt_tiny())
    ref.load_state_dict(model.state_dict())
    settings = TrainSettings(steps=5, warmup_steps=1, eval_batches=2)
    cfg = so.OffloadConfig(device="cpu", bucket_bytes=64 * 1024, ratio=0.5, speculation="on")
    with so.initialize(model, optimizer={"lr": 1e-3, "weight_decay": 0.0}, config=cfg) as engine:
        got = train(engine, model, _sampler(), settings, val_batches=_sampler(1))
    want = train(PlainEngine(ref, lr=1e-3, weight_decay=0.0), ref, _sampler(), settings,
                 val_batches=_sampler(1))
    # fp32 everywhere: the engine's Adam differs from torch's by reassociation only
    assert got.losses == pytest.approx(want.losses, rel=1e-4)
    assert got.val_loss == pytest.approx(want.val_loss, rel=1e-4)
    assert got.summary is not None and got.summary.iterations == 5
    assert got.summary.d2h_bytes_total > 0  # the offloaded half really moved
    assert {s.iteration for s in got.spans} == set(range(5))  # evaluation forwards left out


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="steps"):
        TrainSettings(steps=0).validate()
    with pytest.raises(ValueError, match="min_lr_frac"):
        TrainSettings(min_lr_frac=2.0).validate()


def test_loop_stops_checkpoints_and_resumes_bit_identically() -> None:
    """should_stop ends the loop at a step boundary; a fresh model, optimizer, scheduler and
    sampler restored from that point and `progress` continue exactly as an uninterrupted
    run: same weights bit for bit, same loss and lr history, same first/final loss."""
    settings = TrainSettings(steps=8, warmup_steps=2, eval_batches=0, final_window=3)

    def fresh() -> tuple[GPT, PlainEngine]:
        torch.manual_seed(0)
        model = GPT(gpt_tiny())
        return model, PlainEngine(model, lr=1e-3)

    model, engine = fresh()
    full = train(engine, model, _sampler(), settings)

    model, engine = fresh()
    batches, sched = _sampler(), make_scheduler(engine.optimizer, settings)
    seen: list[Progress] = []
    part = train(engine, model, batches, settings, scheduler=sched, checkpoint_every=2,
                 on_checkpoint=seen.append, should_stop=lambda: len(seen) == 2)
    assert part.stopped and part.steps == 4 and part.val_loss is None
    assert [p.step for p in seen] == [2, 4] and seen[-1].losses == full.losses[:4]
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": engine.optimizer.state_dict(), "sched": sched.state_dict(),
             "data": batches.state_dict(), "progress": Progress.from_dict(seen[-1].to_dict())}
    model, engine = fresh()  # a new "process": nothing carried over but `saved`
    model.load_state_dict(saved["model"])
    # the order engine.load_checkpoint(lr_scheduler=...) keeps: build the scheduler first
    # (its constructor sets the step-0 lr), then restore the optimizer's lr and its own state
    sched = make_scheduler(engine.optimizer, settings)
    engine.optimizer.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    batches = _sampler()
    batches.load_state_dict(saved["data"])
    rest = train(engine, model, batches, settings, scheduler=sched, progress=saved["progress"])
    assert not rest.stopped and rest.start_step == 4 and rest.steps == 8
    assert rest.losses == full.losses and rest.lrs == full.lrs
    assert (rest.first_loss, rest.final_loss, rest.tokens) == (full.first_loss, full.final_loss,
                                                               full.tokens)
    ref, _ = fresh()
    train(PlainEngine(ref, lr=1e-3), ref, _sampler(), settings)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="damaged"):
        Progress.from_dict({"step": 3, "losses": [1.0], "lrs": [], "tokens": 0})


def test_train_command_prints_json_last_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "superoffload", "train", "--steps", "4", "--model", "tiny",
         "--batch", "2", "--seq", "32", "--eval-batches", "1", "--device", "cpu",
         "--out", str(out), "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["steps"] == 4 and result["model"] == "GPT tiny"
    assert result["first_loss"] == pytest.approx(math.log(256), abs=0.15)
    assert math.isfinite(result["final_loss"]) and result["tokens_per_s"] > 0
    assert "report:" in proc.stdout  # the human summary comes before the JSON line
    report = Path(result["report"])
    assert report.exists() and "device compute" in report.read_text()  # the dashboard's lane names
    saved = json.loads((out / "result.json").read_text())
    assert len(saved["iterations"]) == 4 and saved["final_loss"] == result["final_loss"]
    assert "train" in proc.stderr  # the progress bar goes to stderr


def test_train_command_explains_missing_transformers(tmp_path: Path) -> None:
    # hide transformers even where it is installed: sys.modules[name] = None fails its import
    code = ("import sys; sys.modules['transformers'] = None; from superoffload.cli import main; "
            f"sys.exit(main(['train', '--hf', '--steps', '1', '--device', 'cpu', "
            f"'--out', {str(tmp_path / 'hf')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "pip install 'superoffload[hf]'" in proc.stderr
    assert not (tmp_path / "hf").exists()  # refused before any output was written


def test_hf_model_trains_through_the_engine() -> None:
    pytest.importorskip("transformers")
    from superoffload.models.hf_lm import tiny_hf_causal_lm

    model = tiny_hf_causal_lm(block_size=16, n_layer=1, n_embd=32, n_head=2)
    x, y = _sampler().next_batch()
    assert model(x).shape == (2, 16, 256)
    cfg = so.OffloadConfig(device="cpu", bucket_bytes=64 * 1024, ratio=0.5)
    with so.initialize(model, optimizer={"lr": 3e-3}, config=cfg) as engine:
        result = train(engine, model, _sampler(), TrainSettings(steps=8, warmup_steps=1,
                                                                eval_batches=0))
    assert result.final_loss < result.first_loss


def test_engine_benchmark_runs_all_three_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    # a smoke run (1 iteration each) so the benchmark cannot rot; its numbers are not checked
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_engine
    finally:
        sys.path.pop(0)
    out = bench_engine.main(["--device", "cpu", "--model", "tiny", "--batch", "2", "--seq", "16",
                             "--iters", "1", "--rounds", "1", "--warmup", "1", "--json"])
    rows = {r["schedule"]: r for r in out["rows"]}
    supers = [name for name in rows if name.startswith("super")]  # "super" or "super <ratio>"
    assert {"plain", "zero"} <= set(rows) and supers
    assert rows["plain"]["vs_plain"] == 1.0 and rows["zero"]["vs_zero"] == 1.0
    assert all(rows[name]["ratio"] < 1.0 for name in supers)  # the tuned schedule keeps a GPU tail
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out


def test_gpu_check_script_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- the run budget
@pytest.mark.usefixtures("one_thread")
def test_the_run_budget_is_a_lower_bound_of_a_real_step() -> None:
    """`run_budget` refuses a shape only when even a lower bound is absurd, so its bounds must
    stay below a real step (GPT small, fp32, seq 1024 x batch 2, one thread): the bytes of
    the tensors autograd saves for backward (the step's memory peak is higher still), and
    the time of forward + backward against its FLOPs at one core's peak."""
    import time

    from superoffload.cli import build_parser
    from superoffload.commands import run_budget
    from superoffload.commands.train_args import resolve_settings
    from superoffload.models import gpt_small

    seq, batch = 1024, 2
    settings = resolve_settings(build_parser().parse_args(["train", "--seq", str(seq), "--batch",
                                                           str(batch)]), "cpu")
    est = run_budget.estimate(settings, torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(gpt_small(block_size=seq))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randint(0, 256, (batch, seq))
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    seconds = time.perf_counter() - t0
    assert est.activation_bytes <= sum(saved.values()) <= 1.5 * est.activation_bytes, saved
    assert est.flops / run_budget.CPU_PEAK_FLOPS_PER_CORE["fp32"] <= seconds


def test_a_longer_seq_than_the_model_has_positions_is_said(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """--seq above the preset's position table raised it without a word."""
    from superoffload.cli import main

    code = main(["train", "--model", "tiny", "--seq", "96", "--batch", "2", "--steps", "1",
                 "--eval-batches", "0", "--device", "cpu", "--no-report",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("training GPT")]
    assert len(start) == 1 and "positions 64 -> 96 (--seq; the new ones start untrained)" \
        in start[0], start
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["block_size"] == 96
