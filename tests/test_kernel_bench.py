"""The benchmark runs end to end on a tiny size (not a timed test: it checks the table's
shape and the layout generator, never a speed)."""

from __future__ import annotations

from superoffload.cli import main as cli_main
from superoffload.kernels import bench


def test_transformer_layout_has_about_200_tensors_and_the_requested_size():
    sizes = bench.transformer_sizes(2**26)
    assert 190 <= len(sizes) <= 200
    assert sum(sizes) == 2**26
    assert min(sizes) > 0


def test_bench_command_prints_every_method(capsys):
    assert cli_main(["bench", "adam", "--numel", "20000", "--repeats", "1", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    for method in ("ours fp32", "torch AdamW() default (for-loop)", "torch AdamW(foreach=True)",
                   "torch AdamW(fused=True)", "ours bf16 grad + fused bf16 copy",
                   "torch fused + separate bf16 copy", "ours bf16 moments"):
        assert out.count(f"| {method}") == 2, method  # flat and 195 layouts
    assert "| flat (1) |" in out and "| 195 (196) |" in out
