"""What `train` checks before it builds anything, besides each option's own value
(`argtypes`) and the run's size (`run_budget`): a resumed checkpoint that this launch
cannot continue, and tools the options ask for that are not installed."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from superoffload.commands import checkpointing as ck
from superoffload.commands.train_args import RunSettings, UsageError


def check_resume_and_tools(args: argparse.Namespace, s: RunSettings,
                           resume: ck.ResumePoint | None, dp: Any) -> None:
    """UsageError naming the option and the fix; `dp` is the DistInfo under torchrun."""
    if resume is not None:
        if (resume.kind == "zero") != (dp is not None):
            # a ZeRO checkpoint holds one shard per rank: only the same ranks can read it
            run, how = "single-process", "without torchrun"
            if resume.kind == "zero":
                run, how = "data-parallel", "under torchrun with the same --dp/--sp"
            raise UsageError(f"--resume {args.resume}: the checkpoint was written by a "
                             f"{run} run; resume it {how}")
        if resume.step >= s.steps:
            raise UsageError(f"--resume {args.resume}: the checkpoint is at step {resume.step} "
                             f"of {s.steps}; that run is complete, nothing is left to train")
    if args.trace and importlib.util.find_spec("superoffload.telemetry.trace") is None:
        raise UsageError("--trace: this installation has no superoffload.telemetry.trace "
                         "(the trace writer); drop --trace")
    if s.hf:
        from superoffload.models.hf_lm import HF_MISSING, hf_available

        if not hf_available():
            raise UsageError(HF_MISSING)
