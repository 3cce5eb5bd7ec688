"""Refuse a `train` run that is absurd for this machine, with the estimate.

`train --seq 100000` used to raise the small GPT's position table to 100000 rows without a
word and start a first step that had not ended after 10 minutes on 2 CPU cores (it needs
at least 50 GB of activations and 6e14 FLOPs). Before anything is built, ``check_budget``
estimates one optimizer step of the run on one rank, and the final evaluation, and refuses
the run when

* the step's memory (activations plus model state) exceeds the memory of the device that
  holds them (the host's RAM on the CPU, the GPU's on CUDA), shared by the ranks on this host;
* one step takes longer than ``MAX_STEP_S``, or the evaluation (``--eval-batches``
  forwards, a third of a step each) longer than ``MAX_EVAL_S`` and longer than the
  training itself (``--eval-batches 100000`` after 2 steps: hours of evaluation).

Memory is a lower bound: activations as ``ACTIVATION_SHARE`` of Korthikanti et al. 2022
("Reducing activation recomputation", §4: 34 bytes per token and width per 16-bit block, no
seq^2 attention scores, i.e. flash attention; doubled for fp32;
``plan.shapes.ModelShape.activation_bytes``); model state at 16 bytes per parameter
(weights, gradients, fp32 moments). FLOPs: 6 N per token for the matrix products plus
causal attention's 6 L d T (half of the 12 L d T of Kaplan et al. 2020, Appendix: the
causal mask skips half the scores).

Time is estimated in two stages, so a run that could end in reasonable time is not refused:
first at the machine's *peak* rate (``CPU_PEAK_FLOPS_PER_CORE``, ``DEVICE_PEAK_FLOPS``,
above any shipping part): beyond the limits even there, the run is refused. A run whose
bound at peak is above ``PROBE_ABOVE_S`` is then measured on the CPU (``probe``: this
machine's rate for one of the model's own matrix products and for causal attention of its
head size, best of a few tries, well under a second), because real kernels reach a small
part of the peak -- here 1/15 for GPT small's matrix products and 1/20 to 1/45 for causal
attention (11-28 GFLOP/s per core at head size 32, sequence 1024-16384): `train --model tiny
--seq 100000` is 6 min per step at peak and about 2 hours per step in fact.

The evaluation is measured whenever it outweighs the training: more forwards than three per
training step. Whether it is longer than the training does not depend on the machine (both
are counted in the same forwards), only whether it is longer than ``MAX_EVAL_S`` does, and
the peak cannot vouch for that: `--eval-batches 100000 --batch 2` (GPT small) on 64 cores
is 3 s at their peak, under the 20 s probe threshold, and took 15-34 min. The probe also
times a forward of the model's depth at one token (``Rates.forward_fixed_s``): the cost of a
forward that does not shrink with its tokens, which dominates small batches.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from superoffload.commands.train_args import RunSettings, UsageError
from superoffload.plan.shapes import ModelShape
from superoffload.threads import usable_cores

MAX_STEP_S = 600.0
"""A step estimated above this (10 minutes) is refused: `train` runs hundreds of steps."""
MAX_EVAL_S = 120.0
"""A final evaluation estimated above this (2 minutes) and longer than the whole run's
training is refused: a long run may evaluate for long (eight batches of GPT-2 at 1024 tokens
take some 20 minutes on 2 cores, after days of training), a short one may not evaluate for
hours. Measured, the estimate adds a forward's fixed cost to its FLOPs (`Rates`); it stays a
little low (GPT tiny, 16 x 128 tokens: 32 ms a forward measured, 16 ms from the FLOPs
alone), which the margin covers."""
PROBE_ABOVE_S = 20.0
"""A step whose bound at peak exceeds this is measured (`probe`): below it, even a kernel at
1/30 of the peak keeps it within ``MAX_STEP_S``. Not so for the evaluation, whose limit is 5
times shorter and whose small forwards reach less of the peak: it is measured whenever it
outweighs the training (module docstring)."""
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
class Rates:
    """FLOP/s this process reached for the run's own kernel shapes (`probe`)."""

    dense: float
    """One of the model's matrix products (tokens x width @ width x 4 width)."""
    attention: float
    """Causal attention of one head of the model's size, forward and backward."""
    forward_fixed_s: float = 0.0
    """A forward's time that does not shrink with its tokens (Python, dispatch, the small
    ops): the model's depth at one token, 0.1 ms a layer here."""


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """One optimizer step on one rank, and what the machine offers."""

    activation_bytes: float
    """Activations of one rank's forward kept for its backward (a lower bound)."""
    memory_bytes: float
    """Activations plus model state of one rank (a lower bound)."""
    capacity_bytes: float
    """Memory of the device holding them, this rank's share."""
    dense_flops: float
    """Arithmetic of one rank's forward and backward in matrix products (6 N per token)."""
    attention_flops: float
    """... and in causal attention (6 L d T per token)."""
    peak_flops: float
    """This rank's share of the machine's peak FLOP/s."""
    where: str
    """The memory's name: "host memory" or "GPU memory"."""
    measured: Rates | None = None
    """This machine's rates for the run's kernels, when `check_budget` probed them."""

    @property
    def flops(self) -> float:
        return self.dense_flops + self.attention_flops

    @property
    def peak_step_s(self) -> float:
        """The step at the peak rate: a lower bound."""
        return self.flops / self.peak_flops

    @property
    def step_s(self) -> float:
        """The step at the measured rates when probed, else at the peak."""
        if self.measured is None:
            return self.peak_step_s
        return (self.dense_flops / self.measured.dense
                + self.attention_flops / self.measured.attention)

    @property
    def forward_fixed_s(self) -> float:
        return 0.0 if self.measured is None else self.measured.forward_fixed_s

    def train_s(self, steps: int) -> float:
        """`steps` training steps, each three forwards' worth (forward and backward)."""
        return steps * (self.step_s + 3.0 * self.forward_fixed_s)

    def eval_s(self, batches: int) -> float:
        """`batches` evaluation forwards: a third of a step each."""
        return batches * (self.step_s / 3.0 + self.forward_fixed_s)


def _dims(s: RunSettings) -> tuple[int, int, int, int, int]:
    """(layers, width, heads, vocabulary, positions of the preset) of the run's model."""
    # models/hf_lm.py tiny_hf_causal_lm defaults
    if s.hf:
        return 4, 128, 4, 256, s.seq
    from superoffload.models import PRESETS

    cfg = PRESETS[s.model]()
    return cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size


def host_memory_bytes() -> float:
    """Physical memory of this host (``sysconf``; the tests replace it)."""
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _local_ranks() -> int:
    try:
        # torchrun's ranks on this host share its memory and cores
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
    # the position table (never split)
    params = shape.params + max(block, s.seq) * width
    elem_bytes = {"fp32": 4.0, "bf16": 2.0}[s.dtype]
    # Korthikanti's count is of 16-bit blocks (the module docstring): fp32 doubles it
    activations = ACTIVATION_SHARE * shape.activation_bytes() * (elem_bytes / 2.0)
    tokens = batch * seq_rank
    ranks = _local_ranks()
    if device.type == "cuda":
        capacity = float(torch.cuda.get_device_properties(device).total_memory)
        peak, where = DEVICE_PEAK_FLOPS, "GPU memory"
    else:
        capacity = host_memory_bytes() / ranks
        peak = usable_cores() * CPU_PEAK_FLOPS_PER_CORE[s.dtype] / ranks
        where = "host memory"
    state = STATE_BYTES_PER_PARAM * params
    # the optimizer state streams from files (docs/storage.md):
    if s.storage_path is not None:
        # weights and gradients in the model's dtype stay, plus what the host budget allows
        state = 2 * elem_bytes * params + (s.host_memory_budget or 0) * (device.type == "cpu")
    return StepEstimate(activations, activations + state, capacity,
                        tokens * 6.0 * params, tokens * 6.0 * layers * width * s.seq, peak,
                        where)


def _best_s(fn: Callable[[], object], tries: int = 3) -> float:
    """The fastest of `tries` runs of `fn` after one warm-up (noise only slows a run)."""
    fn()
    best = math.inf
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def probe(s: RunSettings) -> Rates:
    """This process's FLOP/s on the CPU, in the run's dtype and threads, for one of the
    model's matrix products and for causal attention (``scaled_dot_product_attention``, as
    the models use) of one head, forward and backward, on up to 1024 tokens."""
    layers, width, heads, _, _ = _dims(s)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[s.dtype]
    # the run's own RNG stays untouched
    gen = torch.Generator().manual_seed(0)
    tokens = min(max(1, s.batch // s.dp) * max(1, s.seq // s.sp), 1024)
    x = torch.randn(tokens, width, generator=gen).to(dtype)
    w = torch.randn(width, 4 * width, generator=gen).to(dtype)
    dense = 2.0 * tokens * width * 4 * width / _best_s(lambda: x @ w)
    seq, head = min(s.seq, 1024), max(1, width // heads)
    q, k, v = (torch.randn(1, 1, seq, head, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))

    def attend() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    # 6 d T^2 of one head (module doc)
    attention = 6.0 * head * seq * seq / _best_s(attend)
    return Rates(dense, attention, forward_fixed_s(s))


# as the evaluation runs
@torch.no_grad()
def forward_fixed_s(s: RunSettings) -> float:
    """A forward of a GPT of the run's layers and heads, 8 wide per head, at one token: what
    a forward costs whatever its tokens (the HF model's is longer: a lower bound there)."""
    from superoffload.models.gpt import GPT, GPTConfig

    layers, _, heads, _, _ = _dims(s)
    # the run's own RNG stays untouched
    with torch.random.fork_rng(devices=[]):
        model = GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=8 * heads, vocab_size=8,
                              block_size=1).validate()).eval()
    x = torch.zeros(1, 1, dtype=torch.long)
    return _best_s(lambda: model(x, x))


def measured(s: RunSettings, device: torch.device) -> StepEstimate:
    """`estimate`, measured on this machine (`probe`) when its bound at peak, for a step or
    the evaluation, is long enough that the peak cannot vouch for it (CPU only)."""
    est = estimate(s, device)
    refused_anyway = est.peak_step_s > MAX_STEP_S or est.memory_bytes > est.capacity_bytes
    longest = max(est.peak_step_s, est.eval_s(s.eval_batches))
    # more forwards than the training's three a step: longer than the training on any
    # machine, so whether it is refused turns on its length here (module docstring)
    outweighs = s.eval_batches > 3 * s.steps
    if device.type == "cpu" and (longest > PROBE_ABOVE_S or outweighs) and not refused_anyway:
        est = replace(est, measured=probe(s))
    return est


def duration(seconds: float) -> str:
    """"2.3 h", "41 min" or "50 s"."""
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _rates(est: StepEstimate) -> str:
    if est.measured is None:
        return f"even at this machine's peak ({est.peak_flops / 1e9:,.0f} GFLOP/s per rank)"
    return (f"at the rates this machine reached for the model's matrix products "
            f"({est.measured.dense / 1e9:,.1f} GFLOP/s) and attention "
            f"({est.measured.attention / 1e9:,.1f} GFLOP/s)")


def check_budget(s: RunSettings, device: torch.device) -> StepEstimate:
    """Raise UsageError when one step of ``s`` cannot fit or cannot end in reasonable time
    here, or its evaluation cannot, with the estimates and what to change; else return the
    estimate."""
    est = measured(s, device)
    problems = []
    if est.memory_bytes > est.capacity_bytes:
        problems.append(f"needs at least {est.memory_bytes / 1e9:.1f} GB of {est.where} for "
                        f"activations and model state, this machine has "
                        f"{est.capacity_bytes / 1e9:.1f} GB per rank")
    if est.step_s > MAX_STEP_S:
        if est.measured is None:
            problems.append(f"needs at least {est.flops:.2g} FLOPs, over "
                            f"{est.step_s / 60:.0f} min per step {_rates(est)}")
        else:
            problems.append(f"needs {est.flops:.2g} FLOPs, about {duration(est.step_s)} per "
                            f"step {_rates(est)}")
    if problems:
        _, _, _, _, block = _dims(s)
        # only the remedies that apply: a GPT's position table bounds --seq (an HF model
        # says its own), checkpointing already on saves nothing more, a GPU run has one
        model, more = "", ""
        if not s.hf:
            model = f" (GPT {s.model} has {block} positions)"
        if not s.checkpointing:
            more += ", --checkpointing"
        if device.type == "cpu":
            more += ", or a GPU"
        raise UsageError(
            f"--seq {s.seq} x --batch {s.batch} is too large for this machine: one step "
            f"{' and '.join(problems)}; use a shorter --seq{model}, a smaller --batch{more}")
    evaluation, training = est.eval_s(s.eval_batches), est.train_s(s.steps)
    if evaluation > max(MAX_EVAL_S, training):
        fits = int(max(MAX_EVAL_S, training) / est.eval_s(1))
        raise UsageError(
            f"--eval-batches {s.eval_batches}: the final evaluation would take about "
            f"{duration(evaluation)} ({s.eval_batches} forwards of {s.batch} x {s.seq} tokens "
            f"{_rates(est)}), longer than {duration(MAX_EVAL_S)} and than the "
            f"{s.steps} training steps ({duration(training)}); use --eval-batches {fits} or "
            "fewer (0 skips it)")
    return est


def grown_positions(s: RunSettings) -> str:
    """"positions 128 -> 512 (...), " when --seq outgrew the preset's position table (the
    start line of `train` says so; it used to happen silently)."""
    if s.hf:
        return ""
    _, _, _, _, block = _dims(s)
    if s.seq <= block:
        return ""
    return f"positions {block} -> {s.seq} (--seq; the new ones start untrained), "
