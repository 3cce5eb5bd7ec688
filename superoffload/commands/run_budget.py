"""Refuse a `train` shape that is absurd for this machine, with the estimate (issue 17).

`train --seq 100000` used to raise the small GPT's position table to 100000 rows without a
word and start a first step that had not ended after 10 minutes on 2 CPU cores (it needs
at least 50 GB of activations and 6e14 FLOPs). Before anything is built, ``check`` estimates one
optimizer step of the run on one rank and refuses it when

* its memory (activations plus model state) exceeds the memory of the device that holds
  them (the host's RAM on the CPU, the GPU's on CUDA), shared by the ranks on this host; or
* its time at the machine's *peak* arithmetic rate exceeds ``MAX_STEP_S``.

Both estimates are lower bounds, so nothing that could run in reasonable time is refused:
activations as ``ACTIVATION_SHARE`` of Korthikanti et al. 2022 ("Reducing activation
recomputation", §4: 34 bytes per token and width per 16-bit block, no seq^2 attention
scores, i.e. flash attention; doubled for fp32; ``plan.shapes.ModelShape.activation_bytes``);
model state at 16 bytes per parameter (weights, gradients, fp32 moments); FLOPs as 6 N per
token plus causal
attention's 6 L d T (half of the 12 L d T of Kaplan et al. 2020, Appendix: the causal mask
skips half the scores); peak rates above any shipping part (``CPU_PEAK_FLOPS_PER_CORE``,
``DEVICE_PEAK_FLOPS``), 15-20x the rate measured on this project's 2-core CI machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from superoffload.commands.train_args import RunSettings, UsageError
from superoffload.plan.shapes import ModelShape
from superoffload.threads import usable_cores

MAX_STEP_S = 600.0
"""A step whose lower bound is above this (10 minutes) is refused: in practice it takes 10x
longer, and `train` runs hundreds of steps."""
CPU_PEAK_FLOPS_PER_CORE = {"fp32": 2.5e11, "bf16": 1.0e12}
"""FLOP/s of one core at best: two 512-bit FMA units at 3.9 GHz for fp32 (250 G); AMX tiles
for bf16 (~1 T). Measured here: 12-18 GFLOP/s per core (fp32 GPT small, seq 4096-16384)."""
DEVICE_PEAK_FLOPS = 2.5e15
"""FLOP/s of one GPU at best: above a B200's dense bf16 (2.25 P)."""
ACTIVATION_SHARE = 0.8
"""Of Korthikanti's count: our GPT's blocks keep 16 values per token and width, not 17 (the
tensors saved for backward of GPT small, fp32, seq 2048 x batch 2, are 143 MB against 159 MB
counted; the peak memory of the step, 179 MB of RSS growth, is higher still)."""
STATE_BYTES_PER_PARAM = 16.0
"""Weights, gradients and two moments in fp32 (the least that lives somewhere per param)."""


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """Lower bounds for one optimizer step on one rank, and what the machine offers."""

    activation_bytes: float
    """Activations of one rank's forward kept for its backward."""
    memory_bytes: float
    """Activations plus model state of one rank."""
    capacity_bytes: float
    """Memory of the device holding them, this rank's share."""
    flops: float
    """Arithmetic of one rank's forward and backward."""
    peak_flops: float
    """This rank's share of the machine's peak FLOP/s."""
    where: str
    """The memory's name: "host memory" or "GPU memory"."""

    @property
    def step_s(self) -> float:
        return self.flops / self.peak_flops


def _dims(s: RunSettings) -> tuple[int, int, int, int, int]:
    """(layers, width, heads, vocabulary, positions of the preset) of the run's model."""
    if s.hf:  # models/hf.py tiny_hf_causal_lm defaults
        return 4, 128, 4, 256, s.seq
    from superoffload.models import PRESETS

    cfg = PRESETS[s.model]()
    return cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size


def host_memory_bytes() -> float:
    """Physical memory of this host (``sysconf``; the tests replace it)."""
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _local_ranks() -> int:
    try:  # torchrun's ranks on this host share its memory and cores
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def estimate(s: RunSettings, device: torch.device) -> StepEstimate:
    """One step of run ``s`` on one rank on ``device`` (module docstring)."""
    layers, width, heads, vocab, block = _dims(s)
    batch, seq_rank = max(1, s.batch // s.dp), max(1, s.seq // s.sp)
    shape = ModelShape(layers=layers, hidden=width, heads=heads, vocab=vocab, seq=seq_rank,
                       micro_batch=batch, activation_checkpointing=s.checkpointing,
                       learned_positions=False, flash_attention=True)
    params = shape.params + max(block, s.seq) * width  # the position table (never split)
    activations = ACTIVATION_SHARE * shape.activation_bytes() * (2.0 if s.dtype == "fp32"
                                                                   else 1.0)
    tokens = batch * seq_rank
    flops = tokens * (6.0 * params + 6.0 * layers * width * s.seq)
    ranks = _local_ranks()
    if device.type == "cuda":
        capacity = float(torch.cuda.get_device_properties(device).total_memory)
        peak, where = DEVICE_PEAK_FLOPS, "GPU memory"
    else:
        capacity = host_memory_bytes() / ranks
        peak = usable_cores() * CPU_PEAK_FLOPS_PER_CORE[s.dtype] / ranks
        where = "host memory"
    return StepEstimate(activations, activations + STATE_BYTES_PER_PARAM * params, capacity,
                        flops, peak, where)


def check(s: RunSettings, device: torch.device) -> StepEstimate:
    """Raise UsageError when one step of ``s`` cannot fit or cannot end in reasonable time
    here, with the estimates and what to change; else return the estimate."""
    est = estimate(s, device)
    problems = []
    if est.memory_bytes > est.capacity_bytes:
        problems.append(f"needs at least {est.memory_bytes / 1e9:.1f} GB of {est.where} for "
                        f"activations and model state, this machine has "
                        f"{est.capacity_bytes / 1e9:.1f} GB per rank")
    if est.step_s > MAX_STEP_S:
        problems.append(f"needs at least {est.flops:.2g} FLOPs, over {est.step_s / 60:.0f} "
                        f"min per step even at this machine's peak "
                        f"({est.peak_flops / 1e9:,.0f} GFLOP/s per rank)")
    if problems:
        _, _, _, _, block = _dims(s)
        model = "" if s.hf else f" (GPT {s.model} has {block} positions)"
        raise UsageError(
            f"--seq {s.seq} x --batch {s.batch} is too large for this machine: one step "
            f"{' and '.join(problems)}; use a shorter --seq{model}, a smaller --batch"
            + ("" if s.checkpointing else ", --checkpointing")
            + (", or a GPU" if device.type == "cpu" else ""))
    return est


def grown_positions(s: RunSettings) -> str:
    """"positions 128 -> 512 (...), " when --seq outgrew the preset's position table (the
    start line of `train` says so; it used to happen silently)."""
    if s.hf:
        return ""
    _, _, _, _, block = _dims(s)
    return (f"positions {block} -> {s.seq} (--seq; the new ones start untrained), "
            if s.seq > block else "")
