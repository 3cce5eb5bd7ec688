"""ZeRO-style data parallel: the offload engine with the sharding transport (paper §4.6).

``ZeroOffloadEngine`` is ``OffloadEngine`` (runtime/engine.py) built with ``ZeroTransport``
(transport.py): the same iteration core, hooks, STV, weight-flow and counters; only the
movement of gradients (reduce-scatter) and weights (all-gather) and the checkpoint format
(one file per rank, checkpoint.py) differ. Build it on every rank after
``superoffload.distributed.init_distributed()``.

Not here: ``weights="auto"`` (runs weight-stationary: every rank must decide alike, and a
host-measured profile may differ between hosts) and ``reconfigure()`` (every rank would have
to apply a change at the same iteration); ``reconfigurable`` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superoffload.config import OffloadConfig
from superoffload.distributed.zero import checkpoint
from superoffload.distributed.zero.budget import DEFAULT_HEADROOM, HostBudget
from superoffload.distributed.zero.transport import ZeroTransport
from superoffload.runtime.engine import OffloadEngine
from superoffload.telemetry.recorder import Recorder


class ZeroOffloadEngine(OffloadEngine):
    """Data-parallel offload engine (see the module docstring).

    Same training API as ``OffloadEngine``; plus the collective ``full_master_weights()`` and
    the sharded ``save_checkpoint``/``load_checkpoint``. ``reduce_mode``: "auto",
    "reduce_scatter" or "all_reduce" (comm.py); ``local_world_size``: ranks sharing this
    host (default: torchrun's LOCAL_WORLD_SIZE or a gather of host names)."""

    def __init__(self, model: torch.nn.Module,
                 optimizer: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                 config: OffloadConfig, telemetry: Recorder | None = None, *,
                 group: Any = None, reduce_mode: str = "auto", inline: bool = False,
                 local_world_size: int | None = None, host_headroom: float = DEFAULT_HEADROOM,
                 host_available_bytes: int | None = None) -> None:
        config = config.validate()
        auto = config.weights == "auto"
        if auto:
            config = config.replace(weights="stationary")
        self.zero = ZeroTransport(group=group, reduce_mode=reduce_mode,
                                  local_world_size=local_world_size, host_headroom=host_headroom,
                                  host_available_bytes=host_available_bytes)
        super().__init__(model, optimizer, config, telemetry, inline=inline, transport=self.zero)
        if auto:
            self.telemetry.note(0, "weights='auto' runs weight-stationary under ZeRO data "
                                   "parallel (every rank must choose alike)")

    # ------------------------------------------------------------------ views
    @property
    def rank(self) -> int:
        """Position in the data-parallel group (which slice of each bucket this rank owns)."""
        return self.zero.shard_rank

    @property
    def world_size(self) -> int:
        return self.zero.world_size

    @property
    def reduce_mode(self) -> str:
        return self.zero.reduce_mode

    @property
    def local_world_size(self) -> int:
        return self.zero.local_ranks

    @property
    def host_budget(self) -> HostBudget | None:
        return self.zero.host_budget

    @property
    def reconfigurable(self) -> frozenset[str]:
        return frozenset()

    # ------------------------------------------------------------------ state
    def full_master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master of every trainable parameter (CPU). Collective: call on every rank."""
        return self.master_weights()

    def state_dict(self) -> dict[str, Any]:
        raise TypeError("ZeroOffloadEngine's state is sharded across ranks: use "
                        "save_checkpoint()/load_checkpoint(), or distributed.zero.consolidate()")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state_dict()

    def save_checkpoint(self, path: str, extra: Any = None, *, lr_scheduler: Any = None) -> str:
        """Sharded: one file per rank plus a manifest (checkpoint.py). Collective."""
        return checkpoint.save(self, path, extra=extra, lr_scheduler=lr_scheduler)

    def load_checkpoint(self, path: str, *, lr_scheduler: Any = None) -> Any:
        """Load a sharded checkpoint written by any world size. Collective; returns extra."""
        return checkpoint.load(self, path, lr_scheduler=lr_scheduler)
