"""Argument types for the command line: each checks one value where argparse parses it, so a
bad value ends in argparse's one-line ``error: argument --flag: ...`` (exit code 2) that names
the flag and the fix, before anything is built or written.

    p.add_argument("--batch", type=positive_int)
    p.add_argument("--bucket-mb", type=bucket_mb)     # the bound is config.MIN_BUCKET_BYTES

argparse prefixes the message with the flag (``argument --batch: ...``); the messages here
say what the value must be. Checks that need two flags or the file system at run time live
in ``train_args.check_args``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from superoffload.config import MIN_BUCKET_BYTES

MiB = 1 << 20


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; give a real value")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (steps, batch, sequence length, repeats, threads, ...)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: use a whole number >= 1")
    return value


def nonneg_int(text: str) -> int:
    """A whole number >= 0 (0 means "none" / "off")."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: use a whole number >= 0")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (learning rate, weight decay, clipping threshold, temperature)."""
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: use a number >= 0")
    return value


def fraction(text: str) -> float:
    """A finite number in [0, 1]."""
    value = _real(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 1]: use a fraction in [0, 1]")
    return value


def bucket_mb(text: str) -> float:
    """A bucket size in MiB whose byte count reaches MIN_BUCKET_BYTES (the bound the engine
    config and the planner use too); nothing is clamped."""
    value = _real(text)
    if int(value * MiB) < MIN_BUCKET_BYTES:
        raise argparse.ArgumentTypeError(
            f"{value} MiB is below the minimum bucket of {MIN_BUCKET_BYTES} bytes: use "
            f">= {MIN_BUCKET_BYTES / MiB:g} (the paper uses 64)")
    return value


BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
"""Suffixes ``byte_size`` takes (case-insensitive): decimal and binary multiples."""


def byte_size(text: str) -> int:
    """A positive number of bytes, with an optional unit: 1500000, 500MB, 8GiB, 1.5TB."""
    stripped = text.strip()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    unit = stripped[len(number):].strip().upper()
    if unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown unit {unit!r}; use a number of bytes with one of "
            f"{', '.join(u for u in BYTE_UNITS if u)} (e.g. 8GiB)")
    value = _real(number) * BYTE_UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is below one byte: use e.g. 8GiB")
    return int(value)


def folder_path(text: str) -> str:
    """A folder that exists or can be made (nothing is created here); a file is refused."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file, not a folder; name a folder")
    return str(path)


def device_name(text: str) -> str:
    """"auto", "cpu", "cuda" or "cuda:N" (whether CUDA is present is checked at run time)."""
    if text in ("auto", "cpu", "cuda"):
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use auto, cpu, cuda or cuda:N")


def out_path(text: str) -> Path:
    """A folder path that is not empty text and not an existing file (whether it may be
    created, or is an existing non-empty folder, is checked at run time)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path would write into the current folder: "
                                         "give a folder name, e.g. runs/mine")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is an existing file, not a folder: choose a "
                                         "folder path")
    return path


def writable_file(text: str) -> Path:
    """A file path whose folder exists and is writable, and which is not a folder itself:
    for options that write one file at the end (``tune --out``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty file name: give a path, e.g. tuned.json")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file path inside it")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {parent} does not exist: create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                    and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not writable: choose another path")
    return path
