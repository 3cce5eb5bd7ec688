"""``superoffload.initialize``: build an engine from a model, hyper-parameters and a configuration
(an ``OffloadConfig`` or a DeepSpeed-style dict, converted once at this edge). Under torchrun
(several processes) the engine runs over FSDP2 (``superoffload.distributed.fsdp``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superoffload.config import OffloadConfig
from superoffload.runtime.engine import OffloadEngine
from superoffload.telemetry.recorder import Recorder

__all__ = ["initialize"]


def initialize(model: torch.nn.Module,
               optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
               config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
               telemetry: Recorder | None = None, **kwargs: Any) -> OffloadEngine:
    """Build an engine. ``config`` may be an OffloadConfig or a DeepSpeed-style dict (or the
    path of its JSON file, as Trainer's ``deepspeed=`` takes), whose optimizer section fills in
    hyperparameters not given in ``optimizer``."""
    if config is None:
        config = OffloadConfig()
    elif isinstance(config, Mapping | str | os.PathLike):
        from superoffload.ds_config import from_deepspeed

        config, ds_opt = from_deepspeed(dict(config) if isinstance(config, Mapping) else config)
        if optimizer is None:
            optimizer = ds_opt
        elif isinstance(optimizer, Mapping):
            optimizer = {**ds_opt, **optimizer}
    elif not isinstance(config, OffloadConfig):
        raise TypeError(f"config: pass an OffloadConfig, a DeepSpeed-style dict or its JSON "
                        f"file's path, not {type(config).__name__}")
    # under torchrun: the engine over FSDP2 (docs/distributed.md)
    if data_parallel():
        from superoffload.distributed.fsdp import FsdpOffloadEngine

        return FsdpOffloadEngine(model, optimizer, config, telemetry, **kwargs)
    return OffloadEngine(model, optimizer, config, telemetry, **kwargs)


def data_parallel() -> bool:
    """More than one process in the job (torch.distributed started, or torchrun's
    WORLD_SIZE > 1, in which case it is started here: superoffload.distributed's
    ``init_distributed``, gloo on the CPU, NCCL with GPUs)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from superoffload.distributed import init_distributed

        init_distributed()
        return True
    return False
