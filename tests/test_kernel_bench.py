"""The benchmark runs end to end on a tiny size (not a timed test: it checks the table's
shape, the rotated interleaving, the DeepSpeed peer's wiring and the layout generator,
never a speed)."""

from __future__ import annotations

import sys
import types

import torch

from superoffload.cli import main as cli_main
from superoffload.kernels import adam_bench

FP32_METHODS = ("ours", "torch AdamW() default (for-loop)", "torch AdamW(foreach=True)",
                "torch AdamW(fused=True)")
MIXED_METHODS = ("ours: bf16 grad in, fused bf16 copy out", "torch fused: widen, step, copy back",
                 "ours + bf16 moments (stochastic rounding)")


def test_transformer_layout_has_about_200_tensors_and_the_requested_size():
    sizes = adam_bench.transformer_sizes(2**26)
    assert 190 <= len(sizes) <= 200
    assert sum(sizes) == 2**26
    assert min(sizes) > 0


def test_bench_command_prints_every_method_and_the_floor(capsys):
    assert cli_main(["bench", "adam", "--numel", "20000", "--repeats", "1", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    for case, methods in ((adam_bench.FP32, FP32_METHODS), (adam_bench.MIXED, MIXED_METHODS)):
        for method in methods:
            assert out.count(f"| {case} | {method} |") == 2, method  # flat and 195 layouts
    assert out.count("| memory floor | STREAM triad") == 2
    assert "| flat (1) |" in out and "| 195 (196) |" in out
    assert out.count("memory floor, ") == 2 and "DeepSpeed CPUAdam" not in out


def test_rounds_are_interleaved_with_the_order_rotated(monkeypatch):
    calls: list[str] = []
    fake = [adam_bench.Method(adam_bench.FP32, name, 28, lambda n=name: calls.append(n))
            for name in "abc"]
    monkeypatch.setattr(adam_bench, "_methods", lambda *a: fake)
    results = adam_bench.run_layout("flat (1)", [64], threads=1, repeats=3, with_deepspeed=False)
    assert calls == list("abc" "bca" "cab" "abc")  # round 0 (warm-up), then rounds 1-3
    assert [r.method for r in results] == list("abc")
    assert adam_bench.rotated([], 5) == []


def test_deepspeed_is_a_peer_when_importable(monkeypatch, capsys):
    """A stand-in for deepspeed.ops.adam (torch's AdamW under DeepSpeed's name and state
    layout): both DeepSpeed rows appear, and every row has a ratio to them."""
    stepped = []

    class DeepSpeedCPUAdam(torch.optim.AdamW):
        def __init__(self, params, lr, weight_decay, adamw_mode):
            assert adamw_mode
            super().__init__(params, lr=lr, weight_decay=weight_decay)

        def step(self, closure=None):
            stepped.append(self.state[self.param_groups[0]["params"][0]]["step"])
            for state in self.state.values():  # DeepSpeed keeps an int step
                state["step"] = torch.tensor(float(state["step"]))
            return super().step(closure)

    module = types.ModuleType("deepspeed.ops.adam")
    module.DeepSpeedCPUAdam = DeepSpeedCPUAdam  # type: ignore[attr-defined]
    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", module)
    adam_bench.run_benchmark(numel=5000, threads=1, repeats=1, layouts=("flat",),
                             with_deepspeed=True)
    out = capsys.readouterr().out
    assert f"| {adam_bench.FP32} | {adam_bench.DEEPSPEED[adam_bench.FP32]} |" in out
    assert f"| {adam_bench.MIXED} | {adam_bench.DEEPSPEED[adam_bench.MIXED]} |" in out
    assert stepped, "the DeepSpeed optimizer was never stepped"
    for line in out.splitlines():
        if line.startswith(("| flat (1) | fp32 ", f"| flat (1) | {adam_bench.MIXED} ")):
            assert line.split("|")[6].strip().endswith("x"), line  # a ratio to DeepSpeed
