"""Training frameworks driving the offload engine: Hugging Face `Trainer` and Accelerate,
PyTorch Lightning.

    # pip install 'superoffload[hf]'
    from superoffload.integrations.hf import SuperOffloadTrainer
    from superoffload.integrations.accelerate import SuperOffloadAccelerator
    # pip install 'superoffload[lightning]'
    from superoffload.integrations.lightning import SuperOffloadStrategy

Each integration imports its framework, so import the submodule you use; this package itself
imports neither. `bridge` holds what both share (engine-owned clipping and accumulation, the
engine's metrics as plain log dicts). See docs/integrations.md.
"""

from __future__ import annotations

# import the submodule you use (each imports its framework)
__all__: list[str] = []
