"""Does the default rollback match AdamW + clip_grad_norm_ under heavy clipping?

The tests' tiny GPT (tests/_tiny_models.py), 20 steps, lr 3e-3, betas (0.9, 0.95), wd 0.1,
4 KiB buckets, ratio 0.9; the loss times k gives gradients k times larger (clip ratio ~k
at max_grad_norm=1). Prints max |w_engine - w_torch| / max |w_torch| for each rollback mode,
and the speculative steps undone (the auto mode declines buckets that are certain to clip).

    python benchmarks/rollback_defaults.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _engine_ref import cpu_config, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

STEPS = 20


class Scaled(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, k: float) -> None:
        super().__init__()
        self.model, self.k = model, k

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y) * self.k


def main() -> None:
    torch.set_num_threads(1)
    data = batches(STEPS)
    print(f"{'clip ratio':>10} {'max_grad_norm':>13} | {'auto (default)':>14} {'rollbacks':>9} | "
          f"{'inverse':>9} {'rollbacks':>9} | {'snapshot':>9}")
    for k, clip in ((1.0, 1.0), (1e2, 1.0), (1e3, 1.0), (1e6, 1.0), (1.0, 1e-3), (1.0, 1e-4)):
        ref = train_reference(Scaled(make_model(), k), data, steps=STEPS, max_norm=clip)
        scale = max(float(v.abs().max()) for v in ref.values())
        row = []
        for mode in ("auto", "inverse", "snapshot"):
            got, stats = train_engine(Scaled(make_model(), k), data,
                                      cpu_config(rollback=mode, max_grad_norm=clip, ratio=0.9),
                                      steps=STEPS)
            row.append((max_diff(ref, got) / scale, stats.rollbacks))
        print(f"{k:>10.0e} {clip:>13g} | {row[0][0]:>14.1e} {row[0][1]:>9} | "
              f"{row[1][0]:>9.1e} {row[1][1]:>9} | {row[2][0]:>9.1e}")


if __name__ == "__main__":
    main()
