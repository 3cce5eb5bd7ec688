"""The offload engine over PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``):
data parallel of the offloaded state (docs/distributed.md, "FSDP2 under the engine").

    from superoffload.distributed import init_distributed
    from superoffload.distributed.fsdp import FsdpOffloadEngine
    init_distributed()                                       # under torchrun
    engine = FsdpOffloadEngine(model, {"lr": 3e-4}, config)  # shards the model if needed

Modules: units.py (FSDP2 units; sharding a plain model), fsdp_transport.py (the engine's
transport over the local shards), hooks.py (ordering FSDP2's collectives with the engine),
flow.py (weight-flow as FSDP2's host-offloaded units), fsdp_engine.py, checkpoint.py (DCP),
legacy.py (reading the former ZeRO engine's checkpoints, to convert them).
``so.CPUAdam`` steps FSDP2 models without any of this (kernels/cpu_adam_optimizer.py).
"""

from superoffload.distributed.fsdp.checkpoint import consolidate
from superoffload.distributed.fsdp.fsdp_engine import FsdpOffloadEngine
from superoffload.distributed.fsdp.fsdp_transport import FsdpTransport
from superoffload.distributed.fsdp.units import fsdp_units, shard_model

__all__ = ["FsdpOffloadEngine", "FsdpTransport", "consolidate", "fsdp_units", "shard_model"]
