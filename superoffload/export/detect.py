"""Which kind of run a source is, told from what it holds (docs/export.md, "Sources").

An object: a live engine, or an object holding one as ``engine`` (``SuperOffloadTrainer``).
A folder, by the file that only that kind of checkpoint has:

========================================  ==============================================
``engine.pt``                             ``engine.save_checkpoint`` (one process)
``manifest.json``                         the FSDP2 engine under torchrun (DCP)
``optimizer.pt`` + ``trainer_state.json``  a ``SuperOffloadTrainer`` ``checkpoint-N``
========================================  ==============================================

Anything else is refused, saying what the folder holds and, when checkpoints lie one level
down (a ``train`` run folder, a Trainer ``output_dir``), naming them.
"""

from __future__ import annotations

import os
from typing import Any

from superoffload.export.source import NotACheckpoint, Source

ENGINE_FILE = "engine.pt"
MANIFEST = "manifest.json"
TRAINER_FILES = ("optimizer.pt", "trainer_state.json")
EXPECTED = ("engine.pt (engine.save_checkpoint), manifest.json (an FSDP2 checkpoint under "
            "torchrun) or optimizer.pt + trainer_state.json (a SuperOffloadTrainer "
            "checkpoint-N)")


def kind_of(path: str) -> str | None:
    """"engine", "dcp", "trainer" or None, from the files in folder ``path``."""
    if os.path.isfile(os.path.join(path, ENGINE_FILE)):
        return "engine"
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return "dcp"
    if all(os.path.isfile(os.path.join(path, f)) for f in TRAINER_FILES):
        return "trainer"
    return None


def open_source(source: Any) -> Source:
    """The reader for ``source`` (a live engine or trainer, or a checkpoint folder)."""
    from superoffload.export.live_engine import LiveSource, engine_of
    from superoffload.export.peft_adapter import PeftLiveSource, is_peft_model

    if not isinstance(source, str | os.PathLike):
        engine = engine_of(source)
        if engine is None:
            raise TypeError(f"export_hf: {type(source).__name__} is neither an offload engine, "
                            "an object holding one (a SuperOffloadTrainer after train()), nor a "
                            "checkpoint folder")
        peft = is_peft_model(getattr(engine, "model", None))
        return PeftLiveSource(engine) if peft else LiveSource(engine)
    path = os.fspath(source)
    if os.path.isfile(path) and os.path.basename(path) in (ENGINE_FILE, MANIFEST):
        # the checkpoint's file given: its folder
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.lexists(path) else "does not exist"
        raise FileNotFoundError(f"export: {path} {what} (expected a checkpoint folder holding "
                                f"{EXPECTED})")
    kind = kind_of(path)
    if kind == "engine":
        from superoffload.export.engine_file import open_engine_checkpoint

        return open_engine_checkpoint(path)
    if kind == "dcp":
        from superoffload.export.dcp import open_dcp_checkpoint

        return open_dcp_checkpoint(path)
    if kind == "trainer":
        return open_trainer_checkpoint(path)
    raise NotACheckpoint(refusal(path))


def open_trainer_checkpoint(path: str) -> Source:
    """A ``checkpoint-N`` folder of ``SuperOffloadTrainer``: masters from optimizer.pt (the
    engine's state dict), config and tokenizer files from the folder."""
    from superoffload.export.companions import folder_extras
    from superoffload.export.engine_file import PayloadSource, check_format, load_mapped
    from superoffload.export.peft_adapter import ADAPTER_CONFIG, PeftCheckpointSource

    file = os.path.join(path, TRAINER_FILES[0])
    payload = load_mapped(file)
    check_format(payload, file, "written by superoffload.integrations.hf.SuperOffloadTrainer "
                                "(its optimizer.pt is the engine's state dict); a plain "
                                "Trainer's checkpoint already holds its model weights")
    extras = folder_extras(path)
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return PeftCheckpointSource(payload, path, extras)
    return PayloadSource(payload, f"Trainer checkpoint {path}", extras=extras)


def refusal(path: str) -> str:
    """Why ``path`` is not exported: what it holds, what an export reads, and the checkpoints
    one level down when there are some."""
    names = sorted(os.listdir(path))
    below = [os.path.join(path, n, c) if c else os.path.join(path, n)
             for n in names if os.path.isdir(os.path.join(path, n))
             for c in _checkpoints_in(os.path.join(path, n))]
    found = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    text = (f"export: {path} is not a checkpoint: it holds {found or 'nothing'}; expected "
            f"{EXPECTED}")
    if below:
        listed = ", ".join(sorted(below)[-6:])
        text += f". Checkpoints inside it: {listed}: pass one of them"
    elif {"config.json"} <= set(names) and any(n.endswith(".safetensors") for n in names):
        text += ". It looks like a Hugging Face model folder already"
    return text


def _checkpoints_in(folder: str) -> list[str]:
    """"" when ``folder`` is a checkpoint, else the checkpoints directly inside it (a
    ``train`` run's checkpoints/step-N)."""
    if kind_of(folder) is not None:
        return [""]
    try:
        subs = sorted(os.listdir(folder))
    except OSError:
        return []
    return [s for s in subs if os.path.isdir(os.path.join(folder, s))
            and kind_of(os.path.join(folder, s)) is not None]
