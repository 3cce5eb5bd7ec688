"""``export_hf``: a run (live, or any checkpoint of it) written as a Hugging Face folder.

The folder (docs/export.md): ``model.safetensors`` or shards plus
``model.safetensors.index.json`` (shards.py), config.json and the tokenizer files when they
are known (companions.py); a peft run gives ``adapter_model.safetensors`` and
``adapter_config.json`` instead (peft_adapter.py). Trainable parameters come from their fp32
masters, written as fp32 (bit for bit) or rounded once to bf16; other floating-point tensors
(buffers, frozen weights) are cast to the same dtype, integer ones kept.

Memory: the writer asks the source for one tensor, casts it, writes its bytes and lets it go
before asking for the next (safetensors_file.py writes each file's header first), so at any
moment it holds one tensor as read plus its cast copy: less than one shard whenever a shard
holds more than one tensor. ``ExportReport.peak_held_bytes`` is that figure, measured (the
tests bound it). The source reads one tensor at a time too (each reader's docstring).

Safety: everything is written into ``<out>.partial-<pid>`` next to ``out`` and renamed to
``out`` once complete, so an export that fails or is killed leaves no half folder under the
name; ``out`` must not exist or be empty (nothing is overwritten); an export that clearly
cannot fit on the disk is refused before writing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from superoffload.export.companions import CONFIG, config_override, with_dtype
from superoffload.export.detect import open_source
from superoffload.export.safetensors_file import TensorSpec, file_order, write_file
from superoffload.export.shards import DEFAULT_MAX_SHARD, ShardPlan, parse_size, plan_shards
from superoffload.export.source import Entry, Source, tensor_of

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype`` -> the dtype floating-point tensors are written in."""


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What ``export_hf`` wrote."""

    out_dir: str
    source: str
    dtype: str
    files: tuple[str, ...]
    """The weight files, in order."""
    index_file: str | None
    tensors: int
    total_bytes: int
    """Bytes of tensor data written (the index's ``total_size``)."""
    config_from: str | None
    """Where config.json came from; None: none was written."""
    peak_held_bytes: int
    """The most tensor bytes the writer held at any moment (measured)."""

    def lines(self) -> list[str]:
        files = f"{len(self.files)} shards + {self.index_file}"
        # one file needs no index (shards.py writes one only for several)
        if len(self.files) == 1:
            files = self.files[0]
        out = [f"export: {self.source} -> {self.out_dir}",
               f"  {self.tensors} tensors, {self.total_bytes / 1e6:,.1f} MB of {self.dtype} in "
               f"{files} (at most {self.peak_held_bytes / 1e6:,.1f} MB held at once)"]
        if self.config_from is not None:
            out.append(f"  config.json from {self.config_from}")
        elif self.files[0].startswith("model"):
            out.append("  no config.json: the model's config is unknown here; pass --config "
                       "<base model folder or config.json> (export_hf(..., config=...)) to add it")
        return out


class _Held:
    """Bytes of the tensors the writer holds now, and the most at once (a tensor counts until
    it is freed: weakref finalizers, so a reference kept by mistake shows here)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, nbytes)
        return t

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes


def export_hf(source: Any, out_dir: str | os.PathLike[str], *, dtype: str = "fp32",
              max_shard_bytes: int | str = DEFAULT_MAX_SHARD,
              config: str | os.PathLike[str] | None = None) -> ExportReport:
    """Write ``source`` as a Hugging Face folder at ``out_dir`` (module docstring).

    ``source``: a live engine (``superoffload.initialize``'s), an object holding one as
    ``engine`` (``SuperOffloadTrainer``), or a checkpoint folder: ``engine.save_checkpoint``'s,
    an FSDP2 checkpoint, or a ``SuperOffloadTrainer`` ``checkpoint-N``. ``dtype``: "fp32"
    (the masters bit for bit) or "bf16". ``max_shard_bytes``: bytes or a size such as "5GB".
    ``config``: a config.json, or a model folder whose config and tokenizer files to use
    (replaces what the source knows)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(EXPORT_DTYPES)}")
    bound = parse_size(max_shard_bytes)
    out = os.fspath(out_dir)
    _check_out(out)
    override = None if config is None else config_override(os.fspath(config))
    src = open_source(source) if not _is_source(source) else source
    try:
        entries = src.entries()
        target = EXPORT_DTYPES[dtype]
        specs = {e.key: TensorSpec(e.key, target if e.dtype.is_floating_point else e.dtype,
                                   e.shape) for e in entries}
        if len(specs) != len(entries):
            raise ValueError(f"{src.what}: two tensors would have the same name in the export")
        plan = plan_shards([(k, s.nbytes) for k, s in specs.items()],
                           2**63 if src.single_file else bound, stem=src.stem)
        _check_space(out, plan.total_bytes)
        held = _Held()
        by_key = {e.key: e for e in entries}
        partial = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            for shard in plan.shards:
                write_file(os.path.join(partial, shard.file),
                           file_order([specs[k] for k in shard.keys]),
                           lambda s: _cast(src, by_key[s.key], s.dtype, held))
            config_from = _write_extras(src, override, partial, plan, target)
            _install(partial, out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    finally:
        src.close()
    return ExportReport(out, src.what, dtype, tuple(s.file for s in plan.shards),
                        plan.index_file, len(entries), plan.total_bytes, config_from, held.peak)


def _is_source(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("entries", "read_master", "read_other", "extras"))


def _cast(src: Source, entry: Entry, dtype: torch.dtype, held: _Held) -> torch.Tensor:
    """One tensor as it is written: read (its fp32 master for a trainable parameter), cast
    once from there (a tied weight is one entry: never rounded twice)."""
    t = held.track(tensor_of(src, entry))
    if t.dtype == dtype:
        return t
    # the read tensor is freed when this returns
    return held.track(t.to(dtype))


def _check_out(out: str) -> None:
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise FileExistsError(f"export: {out} exists and is not an empty folder; nothing was "
                              "written. Choose a new folder (an export never overwrites)")


def _check_space(out: str, nbytes: int) -> None:
    parent = os.path.dirname(os.path.abspath(out))
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        # no statvfs there: find out by writing
        return
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"no space left on device: the export needs {nbytes:,} "
                      f"bytes ({nbytes / 1e9:.2f} GB), {parent} has {free:,} free; nothing was "
                      "written. Free some space or export elsewhere", out)


def _write_extras(src: Source, override: Any, folder: str, plan: ShardPlan,
                  dtype: torch.dtype) -> str | None:
    """The index, config.json (its dtype the export's) and the companion files; returns
    where the config came from (None: no config)."""
    if plan.index_file is not None:
        _write_text(os.path.join(folder, plan.index_file), json.dumps(plan.index(), indent=2))
    extras = src.extras()
    if override is not None:
        extras.config, extras.config_from = override.config, override.config_from
        extras.files.update(override.files)
    for name, path in extras.files.items():
        shutil.copyfile(path, os.path.join(folder, name))
    for name, text in extras.texts.items():
        _write_text(os.path.join(folder, name), text)
    if extras.config is None:
        return None
    _write_text(os.path.join(folder, CONFIG),
                json.dumps(with_dtype(extras.config, dtype), indent=2, sort_keys=True) + "\n")
    return extras.config_from


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _install(partial: str, out: str) -> None:
    """Rename the complete folder to its name (an empty folder there gives way)."""
    if os.path.isdir(out):
        # empty (checked first); a file appearing since fails here, kept
        os.rmdir(out)
    os.replace(partial, out)
