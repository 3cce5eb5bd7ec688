"""A run as a Hugging Face folder: ``export_hf`` and ``python -m superoffload export``
(docs/export.md).

    import superoffload as so
    so.export_hf(engine, "out/model")                       # live: the engine's fp32 masters
    so.export_hf("runs/a/checkpoint", "out/model", dtype="bf16", max_shard_bytes="2GB")

Sources (detect.py): a live engine or ``SuperOffloadTrainer`` (live_engine.py,
peft_adapter.py), an ``engine.save_checkpoint`` folder or a Trainer ``checkpoint-N``
(engine_file.py), an FSDP2 checkpoint (dcp.py). The writer (writer.py) streams one tensor at
a time into safetensors files (safetensors_file.py) laid out by shards.py, with config.json
from companions.py.
``load_gpt`` (gpt_loader.py) reads an export of our GPT back.
"""

from superoffload.export.gpt_loader import load_gpt, load_tensors
from superoffload.export.source import NotACheckpoint
from superoffload.export.writer import ExportReport, export_hf

__all__ = ["ExportReport", "NotACheckpoint", "export_hf", "load_gpt", "load_tensors"]
