"""What a run says about its fp32 masters and how to export them (docs/export.md, "Every
checkpoint says how"): the note a Trainer checkpoint carries and the warning
``trainer.save_model`` gives when it writes low-precision weights. (An engine checkpoint says
it in its meta.json / manifest.json: runtime/ckpt_files.py ``how_to_export``.)
"""

from __future__ import annotations

import os
import warnings

import torch

from superoffload.runtime.ckpt_files import EXPORT_COMMAND

TRAINER_NOTE = "EXPORT.md"


def trainer_checkpoint_note(folder: str, weights_dtype: torch.dtype) -> str:
    """The note (``<checkpoint>/EXPORT.md``) of a ``SuperOffloadTrainer`` checkpoint."""
    dtype = str(weights_dtype).removeprefix("torch.")
    return (
        "# Exporting this checkpoint\n\n"
        f"The model weights here are in the training dtype ({dtype}); `optimizer.pt` holds the "
        "offload engine's fp32 master weights. A Hugging Face folder of the masters (exact; "
        "a tied embedding written once):\n\n"
        f"    {EXPORT_COMMAND} {folder} <out_dir>                 # fp32\n"
        f"    {EXPORT_COMMAND} {folder} <out_dir> --dtype bf16    # rounded once\n\n"
        f"or in Python: `superoffload.export_hf({folder!r}, out_dir)`. A peft model is "
        "exported as its adapter.\n")


def write_trainer_note(folder: str, weights_dtype: torch.dtype) -> None:
    with open(os.path.join(folder, TRAINER_NOTE), "w") as f:
        f.write(trainer_checkpoint_note(folder, weights_dtype))


def warn_masters_exist(output_dir: str, weights_dtype: torch.dtype) -> None:
    """The warning of ``trainer.save_model`` (its caller's caller is the user's line)."""
    warnings.warn(save_model_warning(output_dir, weights_dtype), UserWarning, stacklevel=3)


def save_model_warning(output_dir: str, weights_dtype: torch.dtype) -> str:
    """``trainer.save_model`` wrote low-precision weights: where the fp32 masters are."""
    dtype = str(weights_dtype).removeprefix("torch.")
    return (f"save_model wrote {dtype} weights to {output_dir}; the offload engine holds fp32 "
            "master weights, which are exact: superoffload.export_hf(trainer, out_dir) writes "
            f"them as a Hugging Face folder (or, from a checkpoint: {EXPORT_COMMAND} "
            "<output_dir>/checkpoint-N <out_dir>)")
