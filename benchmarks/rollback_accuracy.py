"""How exact is the kernel's algebraic rollback? (docs/engine.md, "How exact is the inverse?")

Steps 65,536 elements once with a gradient `ratio` times larger than the moments' history,
rolls the step back, and prints the relative error of p, m, v against the pre-step values.
Run: python benchmarks/rollback_accuracy.py
"""

from __future__ import annotations

import torch

import superoffload as so

HPARAMS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


def relative_error(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return (after - before).abs() / before.abs().clamp_min(1e-30)


def main(numel: int = 1 << 16) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'grad/history':>12} | {'median rel err p':>16} | {'m':>8} | {'v':>8} | {'worst v':>8}")
    for ratio in (1, 10, 100, 1000):
        p = torch.randn(numel, generator=gen)
        m = torch.randn(numel, generator=gen) * 1e-3
        v = (torch.randn(numel, generator=gen) * 1e-3) ** 2
        g = torch.randn(numel, generator=gen) * 1e-3 * ratio
        p0, m0, v0 = p.clone(), m.clone(), v.clone()
        so.kernels.adam_step(p, g, m, v, step=10, **HPARAMS)
        so.kernels.adam_rollback(p, g, m, v, step=10, **HPARAMS)
        errs = [relative_error(a, b) for a, b in ((p, p0), (m, m0), (v, v0))]
        print(
            f"{ratio:>12} | {float(errs[0].median()):>16.1e} | {float(errs[1].median()):>8.1e} | "
            f"{float(errs[2].median()):>8.1e} | {float(errs[2].max()):>8.1e}"
        )


if __name__ == "__main__":
    main()
