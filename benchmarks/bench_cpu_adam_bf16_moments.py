"""Accuracy of bf16 moments (stochastic rounding, 20 instead of 28 B/param) on a real run.

Trains the demo GPT (`superoffload.models`, preset "small" by default, the demo's settings:
lr 2e-3 with warmup and cosine decay, betas (0.9, 0.95), weight decay 0.1 on matrices only,
clipping at 1.0) on the embedded
corpus (`superoffload.data`) twice from the same initial weights and the same batches:
`so.CPUAdam` with fp32 moments and with bf16 moments (`moment_dtype=torch.bfloat16`,
DeepSpeed's `fp32_optimizer_states=False`). Optionally a third run with a bf16 model (fp32
masters inside CPUAdam). Prints the training loss (mean of each window of steps) and the
validation loss at the end, as a markdown table; the two runs step in lockstep in one
process, so the machine's load does not matter (the numbers are deterministic).

    # small, 400 steps
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_cpu_adam_bf16_moments.py
    .venv/bin/python benchmarks/bench_cpu_adam_bf16_moments.py --preset tiny --steps 100
"""

from __future__ import annotations

import argparse
import math

import torch

import superoffload as so
from superoffload.data import BatchSampler, load_tokens, split_train_val
from superoffload.models import GPT, PRESETS


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup then cosine to 10% (the demo's schedule shape)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


@torch.no_grad()
def _val_loss(model: torch.nn.Module, val: torch.Tensor, args: argparse.Namespace) -> float:
    sampler = BatchSampler(val, batch_size=args.batch, seq_len=args.seq, seed=123)
    losses = [float(model(*sampler.next_batch())) for _ in range(args.val_batches)]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping (0: off)")
    ap.add_argument("--window", type=int, default=25, help="steps per reported loss")
    ap.add_argument("--val-batches", type=int, default=20)
    ap.add_argument("--bf16-model", action="store_true", help="add a bf16-model run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, val = split_train_val(load_tokens())
    cfg = PRESETS[args.preset](block_size=args.seq)
    torch.manual_seed(args.seed)
    base = GPT(cfg)
    runs: dict[str, tuple[torch.nn.Module, so.CPUAdam]] = {}
    variants = [("fp32 moments", torch.float32, torch.float32),
                ("bf16 moments (SR)", torch.bfloat16, torch.float32)]
    if args.bf16_model:
        variants.append(("bf16 model, fp32 masters, bf16 moments", torch.bfloat16, torch.bfloat16))
    for name, moment_dtype, model_dtype in variants:
        model = GPT(cfg).to(model_dtype)
        model.load_state_dict(base.state_dict())
        params = list(model.parameters())  # the demo's groups: no decay on 1-D tensors
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": args.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = so.CPUAdam(groups, lr=args.lr, betas=(0.9, 0.95), moment_dtype=moment_dtype,
                         threads=args.threads)
        runs[name] = (model, opt)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"[bench] GPT {args.preset}: {n_params:,} params; {args.steps} steps of "
          f"{args.batch} x {args.seq} tokens; lr {args.lr}, wd {args.weight_decay}", flush=True)
    sampler = BatchSampler(train, batch_size=args.batch, seq_len=args.seq, seed=args.seed)
    window: dict[str, list[float]] = {name: [] for name in runs}
    rows: list[tuple[int, dict[str, float]]] = []
    for step in range(args.steps):
        x, y = sampler.next_batch()
        for name, (model, opt) in runs.items():
            for group in opt.param_groups:
                group["lr"] = _lr(step, args.steps, args.lr, args.warmup)
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            window[name].append(float(loss.detach()))
        if (step + 1) % args.window == 0:
            rows.append((step + 1, {k: sum(v) / len(v) for k, v in window.items()}))
            window = {name: [] for name in runs}
            print(f"[bench] step {step + 1}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in rows[-1][1].items()), flush=True)
    names = list(runs)
    print("\n| steps | " + " | ".join(f"train loss, {n}" for n in names) +
          " | bf16 - fp32 |\n|---:|" + "---:|" * (len(names) + 1))
    for step, losses in rows:
        diff = losses[names[1]] - losses[names[0]]
        print(f"| {step} | " + " | ".join(f"{losses[n]:.4f}" for n in names) + f" | {diff:+.4f} |")
    vals = {n: _val_loss(runs[n][0], val, args) for n in names}
    print("| val loss (end) | " + " | ".join(f"{vals[n]:.4f}" for n in names) +
          f" | {vals[names[1]] - vals[names[0]]:+.4f} |")


if __name__ == "__main__":
    main()
