"""The job's ``DeviceMesh``: data parallel (FSDP2's shard and HSDP's replicate dimensions) and
Ulysses sequence parallel as dimensions of one mesh (docs/distributed.md, "Meshes").

The root mesh has three named dimensions, ``(dp_replicate, dp_shard, sp)``, over the ranks in
torchrun's order (``sp`` innermost, so an sp group is consecutive ranks: ``groups.py``):

* ``sp``: the Ulysses all-to-all group (``get_groups().sp_group`` is this dimension's group);
* ``dp_shard`` x ``sp``, flattened to ``dp_shard_sp``: the ranks FSDP2 shards the parameters
  and the offloaded optimizer state over. With Ulysses every rank computes gradients of the
  *whole* model from its own tokens, so the reduction spans all dp*sp ranks of a replica;
* ``dp_replicate``: HSDP's replicas (each holds one full copy of the shards; FSDP2
  all-reduces the reduce-scattered gradients over it). 1 without ``--dp-replicate``.

FSDP2 takes ``fsdp``: the 1-D ``(dp_shard_sp)`` mesh, or the 2-D ``(dp_replicate,
dp_shard_sp)`` one for HSDP. Every process group of the mesh gets the job's collective
timeout (a group made without one waits torch's default 30 min on a stalled peer).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp_replicate", "dp_shard", "sp")
FSDP_DIM = "dp_shard_sp"
DP_DIM = "dp"


@dataclass(frozen=True, slots=True)
class ParallelMesh:
    """This rank's view of the job's mesh (see the module docstring)."""

    root: DeviceMesh
    """``(dp_replicate, dp_shard, sp)``."""
    fsdp: DeviceMesh
    """What ``fully_shard(mesh=...)`` takes: ``(dp_shard_sp)``, or ``(dp_replicate,
    dp_shard_sp)`` for HSDP."""
    dp: DeviceMesh
    """``(dp)``: the data-parallel ranks at this rank's sequence position."""


def _options(device_type: str, timeout_s: float) -> tuple[str, Any]:
    """Backend options carrying the job's timeout (DeviceMesh passes ``_timeout`` on)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    opts = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
            else dist.ProcessGroupGloo._Options())  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=float(timeout_s))
    return backend, opts


def build_mesh(*, dp: int, sp: int, replicate: int, device_type: str,
               timeout_s: float) -> ParallelMesh:
    """Create the mesh of ``dp`` x ``sp`` ranks, the dp ones as ``replicate`` HSDP replicas
    (collective: every rank, in the same order; groups.py plans and checks the numbers)."""
    from torch.distributed.device_mesh import init_device_mesh

    override = _options(device_type, timeout_s)
    shape = (replicate, dp // replicate, sp)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS,
                            backend_override={name: override for name in MESH_DIMS})
    flat = root["dp_shard", "sp"]._flatten(FSDP_DIM, backend_override=override)
    dp_mesh = root["dp_replicate", "dp_shard"]._flatten(DP_DIM, backend_override=override)
    fsdp = root["dp_replicate", FSDP_DIM] if replicate > 1 else flat
    return ParallelMesh(root=root, fsdp=fsdp, dp=dp_mesh)
