"""Regenerate tests/fixtures/cpu_adam_golden.pt: a few KB of reference Adam/AdamW states
computed by PyTorch itself (torch.optim in float64), which tests/test_kernel_golden.py
replays through our fp32 kernel (docs/conventions.md, "Golden data for kernels").

    .venv/bin/python scripts/make_golden.py
"""

from __future__ import annotations

from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "cpu_adam_golden.pt"
NUMEL = 48
STEPS = 4
CASES = {
    "adamw": dict(cls="AdamW", lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    "adam_l2": dict(cls="Adam", lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    "adamw_no_wd": dict(cls="AdamW", lr=3e-3, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.0),
}


def make() -> dict:
    gen = torch.Generator().manual_seed(20260101)
    fixture: dict = {"torch_version": str(torch.__version__), "steps": STEPS, "cases": {}}
    for name, spec in CASES.items():
        spec = dict(spec)
        cls = getattr(torch.optim, spec.pop("cls"))
        p0 = torch.randn(NUMEL, generator=gen)
        grads = torch.randn(STEPS, NUMEL, generator=gen)
        p = p0.double().clone()
        opt = cls([p], **spec)
        for k in range(STEPS):
            p.grad = grads[k].double()
            opt.step()
        state = opt.state[p]
        fixture["cases"][name] = {
            "hparams": {**spec, "adamw_mode": cls is torch.optim.AdamW},
            "p0": p0, "grads": grads,
            "p": p.detach().clone(), "exp_avg": state["exp_avg"].clone(),
            "exp_avg_sq": state["exp_avg_sq"].clone(),
        }
    return fixture


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(make(), OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
