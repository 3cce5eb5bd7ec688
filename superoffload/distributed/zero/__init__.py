"""ZeRO-style data parallel of the offloaded optimizer state (paper §4.6; docs/distributed.md).

    from superoffload.distributed import init_distributed
    from superoffload.distributed.zero import ZeroOffloadEngine
    init_distributed()                                   # under torchrun
    engine = ZeroOffloadEngine(model, {"lr": 3e-4}, config)

The engine is ``OffloadEngine`` with the sharding transport (transport.py): each rank keeps
and steps 1/N of every offloaded bucket. Modules: layout.py (which slice a rank owns),
buffers.py (a shard's buffers), comm.py (reduce-scatter / all-gather tasks), homes.py
(weight-flow's gathered host copies), budget.py and startup.py (host memory, collective
set-up), gather.py (full states), checkpoint.py (one file per rank + manifest, any world size
on load).
"""

from superoffload.distributed.zero.budget import HostBudget, HostMemoryError
from superoffload.distributed.zero.checkpoint import ConsolidatedState, consolidate
from superoffload.distributed.zero.engine import ZeroOffloadEngine
from superoffload.distributed.zero.transport import ZeroTransport

__all__ = ["ConsolidatedState", "HostBudget", "HostMemoryError", "ZeroOffloadEngine",
           "ZeroTransport", "consolidate"]
