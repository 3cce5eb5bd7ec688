"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and superoffload (issue 21; docs/distributed.md,
"FSDP2").

``so.CPUAdam`` steps FSDP2 models as they are (DTensor parameters, local shards, DCP
checkpoints): no code from this package is needed for that. ``FsdpTransport`` is a PROTOTYPE
of the offload engine riding FSDP2's collectives instead of its own ZeRO transport
(transport.py; the measured comparison is in the docs):

    from superoffload.distributed.fsdp import FsdpTransport
    fully_shard(block) for each block; fully_shard(model)
    engine = OffloadEngine(model, {"lr": 3e-4}, OffloadConfig(ratio=1.0), transport=FsdpTransport())
"""

from superoffload.distributed.fsdp.transport import FsdpTransport, fsdp_units

__all__ = ["FsdpTransport", "fsdp_units"]
