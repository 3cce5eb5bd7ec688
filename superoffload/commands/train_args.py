"""`python -m superoffload train`: its options, and the settings of a run resolved from them.

Every option checks its own value where argparse parses it (`argtypes`), so a bad value is
one line naming the flag and the fix, exit code 2, before anything is built or written.
Options that shape the run default to None here and are resolved once by `resolve_settings()`: from
the command line, else from the checkpoint being resumed, else from the per-device
defaults. A resumed run may not change what its numbers depend on (`NUMERICS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from superoffload.commands import argtypes as t
from superoffload.config import choices_of
from superoffload.models.gpt import PRESETS as MODEL_PRESETS
from superoffload.presets import CONFIG_PRESETS

TRAIN_DTYPES = tuple(p for p in choices_of("precision") if p != "fp16")
"""``--dtype``: ``OffloadConfig.precision``'s values but fp16: the command builds its model
in fp32 or bf16 only (commands/train.py); fp16 models train through ``so.initialize``."""

PROG = "python -m superoffload train"


class UsageError(ValueError):
    """A command-line value or combination the run cannot use; the message names the flag
    and the fix. The CLI prints it as one argparse-style line and exits with code 2."""


# Per-device defaults: a few minutes on 2 CPU cores, a bigger model on a GPU.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"model": "small", "batch": 16, "seq": 128, "lr": 2e-3, "dtype": "fp32"},
    "cuda": {"model": "medium", "batch": 32, "seq": 256, "lr": 1e-3, "dtype": "bf16"},
}
COMMON_DEFAULTS: dict[str, Any] = {
    "steps": 300, "warmup": 20, "weight_decay": 0.1, "max_grad_norm": 1.0, "seed": 0,
    "hf": False, "preset": "auto", "ratio": None, "bucket_mb": None, "speculation": None,
    "weights": None, "checkpointing": False, "eval_batches": 8, "storage_path": None,
    "host_memory_budget": None, "storage_buffers": None,
}


STORAGE_FIELDS = {"storage_path": "storage_path", "host_memory_budget": "host_memory_budget_bytes",
                  "storage_buffers": "storage_buffer_count"}
"""The run's storage-tier settings and the OffloadConfig field each sets (docs/storage.md)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """What a training run is: saved in its checkpoints and restored by --resume."""

    model: str
    hf: bool
    batch: int
    """Global batch (sequences per optimizer step over every data-parallel rank)."""
    seq: int
    lr: float
    warmup: int
    weight_decay: float
    max_grad_norm: float
    """0 disables clipping."""
    seed: int
    steps: int
    dtype: str
    dp: int
    sp: int
    preset: str
    ratio: float | None
    bucket_mb: float | None
    speculation: str | None
    weights: str | None
    checkpointing: bool
    eval_batches: int
    storage_path: str | None = None
    """The storage tier's folder (``OffloadConfig.storage_path``), or None."""
    host_memory_budget: int | None = None
    """Bytes (``OffloadConfig.host_memory_budget_bytes``), or None."""
    storage_buffers: int | None = None
    """``OffloadConfig.storage_buffer_count``, or None for the preset's."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NUMERICS = ("model", "hf", "batch", "seq", "lr", "warmup", "weight_decay", "max_grad_norm",
            "seed", "steps", "dtype", "dp", "sp")
"""Settings a resumed run must keep: its losses and weights depend on them. The others only
place or schedule work (the engine checkpoint loads under other values too)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The train command's options (defaults in the help text; None means "resolve later")."""
    p.add_argument("--steps", type=t.positive_int, help="optimizer steps (default 300)")
    p.add_argument("--model", choices=tuple(MODEL_PRESETS),
                   help="GPT size (default: small on CPU, medium on CUDA)")
    p.add_argument("--batch", type=t.positive_int, help="sequences per step (default 16 on "
                   "CPU, 32 on CUDA; the global batch under torchrun)")
    p.add_argument("--seq", type=t.positive_int, help="tokens per sequence (128 CPU, 256 CUDA)")
    p.add_argument("--lr", type=t.nonneg_float, help="peak learning rate (2e-3 CPU, 1e-3 CUDA)")
    p.add_argument("--warmup", type=t.nonneg_int, help="warm-up steps (default 20)")
    p.add_argument("--weight-decay", type=t.nonneg_float, help="AdamW decay (default 0.1)")
    p.add_argument("--max-grad-norm", type=t.nonneg_float,
                   help="clip threshold; 0 disables (default 1.0)")
    p.add_argument("--preset", choices=("auto", *CONFIG_PRESETS),
                   help="engine settings to start from (default: tiny_cpu on CPU, pcie_host "
                        "on CUDA); the options below override them")
    p.add_argument("--ratio", type=t.fraction,
                   help="share of the optimizer work offloaded to the CPU (paper §4.2)")
    p.add_argument("--bucket-mb", type=t.bucket_mb,
                   help="bucket size in MiB of fp32 gradient (paper §4.2)")
    p.add_argument("--speculation", choices=choices_of("speculation"),
                   help="speculation-then-validation mode (paper §4.3)")
    p.add_argument("--weights", choices=choices_of("weights"),
                   help="weight policy (paper §4.5): keep the weights on the device, stream "
                        "the blocks from the host (flow), or let the cost model choose; "
                        "default: the preset's (works with --dp/--sp too)")
    p.add_argument("--storage-path", type=t.folder_path, metavar="DIR",
                   help="keep the optimizer state of offloaded buckets in files under DIR, "
                        "streamed through pinned buffers (docs/storage.md)")
    p.add_argument("--host-memory-budget", type=t.byte_size, metavar="SIZE",
                   help="cap on the host memory the engine keeps, e.g. 8GiB or 500MB; with "
                        "--storage-path what does not fit lives in files")
    p.add_argument("--storage-buffers", type=t.positive_int, metavar="N",
                   help="pinned buffers of the storage tier, one bucket each (default 4)")
    p.add_argument("--device", type=t.device_name, default="auto",
                   help='"auto", "cpu", "cuda" or "cuda:N"')
    p.add_argument("--dtype", choices=TRAIN_DTYPES,
                   help="model weight dtype (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--checkpointing", action="store_true", default=None,
                   help="activation checkpointing")
    p.add_argument("--seed", type=int, help="model init, batch order and sampling (default 0)")
    p.add_argument("--eval-batches", type=t.nonneg_int,
                   help="held-out batches at the end (default 8; 0 skips)")
    p.add_argument("--out", type=t.out_path, default=None,
                   help="output folder, new or empty (default runs/<timestamp>, linked as "
                        "runs/latest; with --resume: the resumed run's folder)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--trace", action="store_true",
                   help="also write <out>/trace.json, a Chrome/Perfetto trace of the run")
    p.add_argument("--save-checkpoint", action="store_true",
                   help="save the engine checkpoint to <out>/checkpoint at the end")
    p.add_argument("--checkpoint-every", type=t.nonneg_int, default=0, metavar="N",
                   help="save a checkpoint every N steps into <out>/checkpoints/step-<N> "
                        "(atomically; 0: never, the default)")
    p.add_argument("--keep-checkpoints", type=t.positive_int, default=2, metavar="K",
                   help="periodic checkpoints kept: the latest K (default 2)")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue a run from a checkpoint: a run folder (its latest "
                        "checkpoint), <out>/checkpoints, or one checkpoint folder")
    p.add_argument("--sample-temperature", type=t.nonneg_float, default=0.8,
                   help="temperature of the text sampled at the end (default 0.8; 0: greedy)")
    p.add_argument("--sample-top-k", type=t.nonneg_int, default=40,
                   help="sample among the k likeliest bytes (default 40; 0: all 256)")
    p.add_argument("--hf", action="store_true", default=None,
                   help="train a tiny Hugging Face GPT-2 (needs the optional transformers)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def resolve_settings(args: argparse.Namespace, device_type: str, *, dp: int = 1, sp: int = 1,
                     saved: Mapping[str, Any] | None = None) -> RunSettings:
    """The run's settings: given on the command line, else the resumed checkpoint's, else the
    defaults. Raises UsageError when a resumed run would change one of `NUMERICS`."""
    base: dict[str, Any] = {**COMMON_DEFAULTS, **DEVICE_DEFAULTS[device_type], "dp": dp, "sp": sp}
    given = {name: _given(args, name) for name in (f.name for f in dataclasses.fields(RunSettings))}
    given["dp"], given["sp"] = dp, sp
    if saved is not None:
        for name in NUMERICS:
            if given[name] is None or name not in saved or given[name] == saved[name]:
                continue
            if name in ("dp", "sp"):
                raise UsageError(
                    f"this launch has {name}={given[name]} but the checkpoint's run used "
                    f"{saved[name]}; launch with the same --dp/--sp (and torchrun "
                    "--nproc-per-node) to continue it")
            raise UsageError(
                f"{flag(name)} {given[name]!r} differs from the checkpoint's run "
                f"({saved[name]!r}): drop {flag(name)} to continue that run, or start a new "
                "run without --resume")
        base.update({k: v for k, v in saved.items() if k in base})
    values = {name: given[name] if given[name] is not None else base[name] for name in given}
    settings = RunSettings(**values)
    check_args(settings)
    return settings


def _given(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    if name in ("preset", "dtype") and value == "auto":
        return None if name == "dtype" else value
    return value


def check_args(s: RunSettings) -> None:
    """Combinations of values that each flag's own check cannot see."""
    if s.lr * s.weight_decay >= 1.0:
        raise UsageError(
            f"--lr {s.lr:g} x --weight-decay {s.weight_decay:g} = {s.lr * s.weight_decay:g}: "
            "AdamW multiplies the weights by 1 - lr x weight decay, which must stay positive; "
            "lower one of them")
    if s.batch % s.dp:
        raise UsageError(f"--batch {s.batch} must be a multiple of the data-parallel degree "
                         f"{s.dp} (each rank takes an equal share)")
    if s.hf and s.sp > 1:
        raise UsageError("--hf with --sp > 1: sequence parallel is wired for our GPT only; "
                         "drop --hf (Hugging Face models: docs/distributed.md)")


OWN_PREFIX = ".superoffload-"
"""Names `train` keeps in a run folder for itself (its lock, a write probe): a folder holding
only those counts as empty."""


def check_out(out: Path, resume_run: Path | None) -> None:
    """--out must be new or empty: a finished run's files are never overwritten. Resuming
    into the folder the checkpoint belongs to is the exception."""
    if not out.exists():
        return
    if resume_run is not None and out.resolve() == resume_run.resolve():
        return
    if not out.is_dir() or any(not p.name.startswith(OWN_PREFIX) for p in out.iterdir()):
        raise UsageError(f"--out {out}: the folder exists and is not empty (another run's "
                         "files would be overwritten); choose a new folder, or --resume "
                         f"{out} to continue the run saved there")


def make_out(out: Path) -> Path:
    """Create --out (and its parents); an OSError becomes a UsageError naming the folder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        # two runs never share it
        probe = out / f"{OWN_PREFIX}write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose a "
                         "writable folder") from None
    return out
