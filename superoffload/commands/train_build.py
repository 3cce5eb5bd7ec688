"""What a `train` run builds from its settings: the device, the model, the engine's
configuration (a preset with the user's options on top) and the param groups."""

from __future__ import annotations

from typing import Any

import torch

from superoffload.commands.train_args import STORAGE_FIELDS, RunSettings, UsageError
from superoffload.config import OffloadConfig

MiB = 1 << 20


def resolve_device(name: str) -> torch.device:
    """``--device``: "auto" is CUDA when there is one; a CUDA device without CUDA is refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; "
                         "use --device cpu")
    return device


def build_model(s: RunSettings) -> torch.nn.Module:
    """The run's model: our GPT of ``--model``, or a tiny Hugging Face GPT-2 (``--hf``)."""
    if s.hf:
        from superoffload.models.hf_lm import tiny_hf_causal_lm

        return tiny_hf_causal_lm(block_size=s.seq, seed=s.seed)
    from superoffload.models import GPT, PRESETS

    torch.manual_seed(s.seed)
    cfg = PRESETS[s.model](checkpointing=s.checkpointing)
    # said in the start line (_train); run_budget bounded it
    if s.seq > cfg.block_size:
        cfg.block_size = s.seq
    return GPT(cfg)


def run_config(s: RunSettings, device: torch.device) -> OffloadConfig:
    """The preset for this device, with the options the user gave applied on top."""
    from superoffload import presets

    name = s.preset
    if name == "auto":
        name = "pcie_host" if device.type == "cuda" else "tiny_cpu"
    changes: dict[str, Any] = {"device": str(device), "seed": s.seed,
                               "max_grad_norm": s.max_grad_norm or None}
    for key in ("ratio", "speculation", "weights"):
        if getattr(s, key) is not None:
            changes[key] = getattr(s, key)
    # argtypes.bucket_mb checked it against MIN_BUCKET_BYTES
    if s.bucket_mb is not None:
        changes["bucket_bytes"] = int(s.bucket_mb * MiB)
    changes.update({field: getattr(s, ours) for ours, field in STORAGE_FIELDS.items()
                    if getattr(s, ours) is not None})
    if device.type == "cpu":
        # nothing to pin without a device link
        changes["pin_memory"] = False
    try:
        return presets.CONFIG_PRESETS[name]().replace(**changes)
    except ValueError as exc:
        raise UsageError(f"invalid engine option: {exc}") from None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups (nanoGPT, GPT-3 §C): weight decay on matrices and embeddings, none on
    biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
