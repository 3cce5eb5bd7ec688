"""The device's speed for THIS model: its own matmul shapes, attention, element-wise passes and
the host's cost per operation, measured on the machine.

A square-matmul probe is not what a model reaches: FACTS.md's H200 measured 708 TFLOP/s on
one, the 1.21 B GPT trained at the equivalent of 533; and on a 2-core CPU a 121 K-parameter
model is all Python and dispatch. So ``probe_model(shape, profile)`` times, on the device the
profile describes (torch, the model's dtype):

* matmuls: each distinct (tokens x in -> out) GEMM of a block and of the head, with its two
  backward GEMMs (dX = dY W^T, dW = X^T dY), tokens capped so one call stays ~2 GFLOP (the
  rate of a larger M is the same or better): FLOP-weighted rate -> device_achieved_tflops;
* attention: scaled_dot_product_attention at (micro-batch, heads, seq, head width), causal,
  forward + backward, counted at the planner's FLOPs (plan/formulas.py) -> folded into the
  same rate by FLOP weight;
* element-wise passes: LayerNorm, GELU and a residual add over a block's activations, bytes
  as plan/formulas.py counts them -> device_nongemm_gbps;
* dispatch: forward + backward of a stand-in decoder (the operations of plan/formulas.py's
  count, width 8, 4 tokens: nothing to compute) -> seconds per operation, device_op_s.

Every figure is the median of `trials` timed repetitions after a warm-up; the spread
((max - min) / median) of each goes in ``extra["probe"]``, and a spread above
``timing.SPREAD_WARN`` or a busy host adds a flag (plan/timing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from superoffload.plan import formulas
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.timing import busy_flags, repeat

GEMM_FLOP_CAP = 2e9
"""FLOPs of one probe call at most (tokens are capped to stay under it)."""
STANDIN_LAYERS = 4


def _gemms(shape: ModelShape) -> list[tuple[int, int, int]]:
    """(in, out, count per iteration) of the model's GEMMs: the block's (x layers) and the
    head; tokens are the shape's."""
    h, q, kv, f = formulas.widths(shape)
    if (q, kv) != (h, h):
        # separate Q, K and V projections (K and V alike: GQA or another head width), then O
        block = [(h, q, 1), (h, kv, 2), (q, h, 1)]
    else:
        # our GPT's fused QKV projection (3h wide), then O
        block = [(h, 3 * h, 1), (h, h, 1)]
    if shape.gated_mlp:
        # gate and up are two h -> f GEMMs, then down
        mlp = [(h, f, 2), (f, h, 1)]
    else:
        mlp = [(h, f, 1), (f, h, 1)]
    # an MoE token runs k experts' MLPs
    k = shape.experts_per_token or 1
    out = [(i, o, n * shape.layers) for i, o, n in block]
    out += [(i, o, n * shape.layers * k) for i, o, n in mlp]
    return out + [(h, shape.vocab, 1)]


def probe_model(shape: ModelShape, profile: HardwareProfile, *, trials: int = 5,
                device: str | None = None) -> HardwareProfile:
    """`profile` with the compute figures of `shape` measured here (module docstring)."""
    import torch

    dev = device
    if not dev:
        # a CUDA profile is probed on CUDA when this machine has it; anything else on the CPU
        dev = "cuda" if profile.device_type == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[shape.dtype]
    if dev == "cpu" and dtype == torch.float16:
        # no fast fp16 matmul on a CPU: the engine trains fp32 there
        dtype = torch.float32
    # CUDA kernels run asynchronously: a timed call ends when the device is done
    sync: Callable[[], None] = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    raw: dict[str, Any] = {"device": dev, "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad():
        flops, seconds, spreads = 0.0, 0.0, []
        for k_in, k_out, count in _gemms(shape):
            m = max(16, min(shape.tokens, int(GEMM_FLOP_CAP / (2 * k_in * k_out))))
            x = torch.randn(m, k_in, device=dev, dtype=dtype)
            w = torch.randn(k_in, k_out, device=dev, dtype=dtype)
            dy = torch.randn(m, k_out, device=dev, dtype=dtype)

            def three(x: Any = x, w: Any = w, dy: Any = dy) -> None:
                x @ w  # forward, then the two backward GEMMs of the same size
                dy @ w.T
                x.T @ dy

            t, spread = repeat(three, trials, sync)
            flops += 3 * 2.0 * m * k_in * k_out * count * shape.tokens / m
            seconds += t * count * shape.tokens / m
            spreads.append(spread)
    att_s, att_spread = _attention(shape, dev, dtype, trials, sync)
    att_flops = 3 * formulas.attention_flops_per_token(shape) * shape.tokens * shape.layers
    tflops = (flops + att_flops) / (seconds + att_s * shape.layers) / 1e12
    gbps, bw_spread = _elementwise(shape, dev, dtype, trials, sync)
    op_s, op_spread = dispatch_op_s(dev, dtype, trials, sync)
    raw.update(gemm_s=seconds, attention_s=att_s * shape.layers, nongemm_gbps=gbps, op_s=op_s,
               spread={"gemm": max(spreads), "attention": att_spread, "elementwise": bw_spread,
                       "dispatch": op_spread})
    flags = tuple(f for f in profile.flags if not f.startswith("busy")) + busy_flags(
        raw["spread"])
    what = (f"probed on this machine for {shape.layers} x {shape.hidden}, {shape.tokens} "
            "tokens (plan/probe.py)")
    sources = dict(profile.sources)
    sources.update(device_achieved_tflops=f"measured: the model's GEMMs and attention, {what}",
                   device_nongemm_gbps=f"measured: element-wise passes, {what}",
                   device_op_s=f"measured: dispatch per operation, {what}")
    return profile.replace(device_achieved_tflops=tflops,
                           device_peak_tflops=max(profile.device_peak_tflops, tflops),
                           device_nongemm_gbps=gbps, device_op_s=op_s, flags=flags,
                           sources=tuple(sources.items()),
                           extra={**profile.extra, "probe": raw})


def _attention(shape: ModelShape, dev: str, dtype: Any, trials: int,
               sync: Callable[[], None]) -> tuple[float, float]:
    """Seconds of one block's attention core, forward + backward (and its spread)."""
    import torch
    import torch.nn.functional as F

    hd = formulas.widths(shape)[1] // shape.heads
    q, k, v = (torch.randn(shape.micro_batch, shape.heads, shape.seq, hd, device=dev,
                           dtype=dtype, requires_grad=True) for _ in range(3))

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return repeat(run, trials, sync)


def _elementwise(shape: ModelShape, dev: str, dtype: Any, trials: int,
                 sync: Callable[[], None]) -> tuple[float, float]:
    """GB/s of a LayerNorm, a GELU and a residual add over one block's activations."""
    import torch
    import torch.nn.functional as F

    t = min(shape.tokens, 8192)
    h, _, _, f = formulas.widths(shape)
    x = torch.randn(t, h, device=dev, dtype=dtype)
    y = torch.randn(t, f, device=dev, dtype=dtype)
    size = x.element_size()

    def run() -> None:
        F.layer_norm(x, (h,))
        F.gelu(y)
        x + x

    seconds, spread = repeat(run, trials, sync)
    moved = (2 * t * h + 2 * t * f + 3 * t * h) * size  # read + write each
    return moved / seconds / 1e9, spread


def dispatch_op_s(dev: str, dtype: Any, trials: int, sync: Callable[[], None] = lambda: None
                  ) -> tuple[float, float]:
    """Seconds per operation of a stand-in decoder's forward + backward with nothing to
    compute (width 8, 4 tokens): plan/formulas.py's operation count divides the time."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    width, heads = 8, 2

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
            q, k, v = (z.view(b, t, heads, width // heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).contiguous().view(b, t, width))
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    model = nn.Sequential(*[Block() for _ in range(STANDIN_LAYERS)]).to(dev, dtype)
    x = torch.randn(1, 4, width, device=dev, dtype=dtype)

    def run() -> None:
        model(x).sum().backward()

    seconds, spread = repeat(run, trials, sync)
    ops = 3.0 * STANDIN_LAYERS * formulas.OPS_PER_BLOCK  # forward + 2x backward
    return seconds / ops, spread
