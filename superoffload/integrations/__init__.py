"""Training frameworks driving the offload engine: Hugging Face `Trainer` and Accelerate,
PyTorch Lightning.

    from superoffload.integrations.hf import SuperOffloadTrainer                  # pip install 'superoffload[hf]'
    from superoffload.integrations.accelerate import SuperOffloadAccelerator      # pip install 'superoffload[hf]'
    from superoffload.integrations.lightning import SuperOffloadStrategy          # pip install 'superoffload[lightning]'

Each integration imports its framework, so import the submodule you use; this package itself
imports neither. `bridge` holds what both share (engine-owned clipping and accumulation, the
engine's metrics as plain log dicts). See docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []  # import the submodule you use (each imports its framework)
