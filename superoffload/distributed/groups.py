"""Data-parallel x sequence-parallel rank layout: a pure function plus a thin group factory.

`world_size = dp * sp` ranks form a 2-D grid. Sequence-parallel (Ulysses) groups are runs of
*consecutive* ranks, so that with torchrun's rank numbering (node-major) an sp group sits on one
node whenever sp <= GPUs per node: Ulysses does two all-to-alls per attention layer in forward
and two in backward, which want the fastest link (DeepSpeed-Ulysses, Jacobs et al. 2023, §3;
Megatron orders tensor-parallel ranks the same way). Data-parallel groups are the strided
columns: rank r has coordinates (dp_rank, sp_rank) = divmod(r, sp).

    layout = plan_parallel_layout(4, sp=2)  # dp inferred: 2
    layout.sp_groups == ((0, 1), (2, 3)); layout.dp_groups == ((0, 2), (1, 3))

Gradients of a model trained with dp x sp are averaged over *all* dp*sp ranks (every rank saw
a distinct slice of tokens of the global batch); see docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from superoffload.distributed.mesh import ParallelMesh, build_mesh

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Which ranks form each data-parallel and each sequence-parallel group."""

    world_size: int
    """Number of ranks (processes), = dp * sp."""
    dp: int
    """Data-parallel degree: number of model replicas, each on a different slice of the batch."""
    sp: int
    """Sequence-parallel degree: ranks that split one sequence (Ulysses)."""
    sp_groups: tuple[tuple[int, ...], ...]
    """dp groups of sp consecutive ranks each."""
    dp_groups: tuple[tuple[int, ...], ...]
    """sp groups of dp ranks each, strided by sp."""
    replicate: int = 1
    """HSDP: the dp ranks form ``replicate`` replicas, each sharding the model over
    ``dp // replicate`` ranks (x sp); 1 shards over every dp rank (mesh.py)."""

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, sp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size}): pass a global rank")
        return divmod(rank, self.sp)

    def sp_group_of(self, rank: int) -> tuple[int, ...]:
        return self.sp_groups[self.coords(rank)[0]]

    def dp_group_of(self, rank: int) -> tuple[int, ...]:
        return self.dp_groups[self.coords(rank)[1]]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: use a whole number >= 1")
    return value


def plan_parallel_layout(world_size: int, *, dp: int | None = None, sp: int = 1,
                         replicate: int = 1) -> ParallelLayout:
    """Compute the rank lists for `--dp dp --sp sp` on `world_size` ranks (pure; no torch).

    `dp=None` infers dp = world_size // sp. Raises ValueError naming the numbers when
    dp * sp != world_size, or when `replicate` (HSDP replicas, `--dp-replicate`) does not
    divide dp.
    """
    world_size = _positive_int("world_size", world_size)
    sp = _positive_int("sp", sp)
    if dp is None:
        if world_size % sp:
            raise ValueError(
                f"--sp {sp} does not divide the world size {world_size}: launch a multiple of "
                f"{sp} processes (torchrun --nproc-per-node) or choose an --sp that divides "
                f"{world_size}"
            )
        dp = world_size // sp
    dp = _positive_int("dp", dp)
    if dp * sp != world_size:
        # the --dp that would fit, when --sp divides the world at all
        fitting_dp = "?"
        if world_size % sp == 0:
            fitting_dp = str(world_size // sp)
        raise ValueError(
            f"--dp {dp} x --sp {sp} = {dp * sp} does not match the world size {world_size}: "
            f"launch dp*sp processes or pass --dp {fitting_dp} for --sp {sp}"
        )
    replicate = _positive_int("replicate", replicate)
    if dp % replicate:
        raise ValueError(
            f"--dp-replicate {replicate} does not divide --dp {dp}: HSDP splits the dp ranks "
            f"into replicas of equal size; use a divisor of {dp}")
    sp_groups = tuple(tuple(d * sp + s for s in range(sp)) for d in range(dp))
    dp_groups = tuple(tuple(d * sp + s for d in range(dp)) for s in range(sp))
    return ParallelLayout(world_size=world_size, dp=dp, sp=sp, sp_groups=sp_groups,
                          dp_groups=dp_groups, replicate=replicate)


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This rank's process groups (torch.distributed objects) for a layout."""

    layout: ParallelLayout
    dp_group: ProcessGroup
    """The ranks holding the same sequence shard of different batch slices."""
    sp_group: ProcessGroup
    """The ranks splitting this rank's sequences (the Ulysses all-to-all group): the ``sp``
    dimension of ``mesh``."""
    world_group: ProcessGroup
    """All ranks: average gradients over this one when training with dp x sp."""
    mesh: ParallelMesh
    """The job's DeviceMesh (mesh.py): FSDP2 shards over ``mesh.fsdp``."""


def create_groups(layout: ParallelLayout, *, timeout_s: float,
                  device_type: str = "cpu") -> ParallelGroups:
    """Create the mesh of `layout` (mesh.py) and return this rank's groups.

    Collective: every rank must call it, in the same order relative to other group creations
    (torch.distributed.new_group's contract). ``timeout_s``: the groups' collective timeout
    (a subgroup does not inherit the world group's; without one it gets torch's 30 min).
    ``device_type``: "cuda" for NCCL, "cpu" for gloo.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("create_groups: torch.distributed is not initialised: call "
                           "superoffload.distributed.init_distributed() first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"create_groups: layout.world_size={layout.world_size} but the process group has "
            f"{dist.get_world_size()} ranks: plan the layout with dist.get_world_size()"
        )
    world = dist.group.WORLD
    assert world is not None
    mesh = build_mesh(dp=layout.dp, sp=layout.sp, replicate=layout.replicate,
                      device_type=device_type, timeout_s=timeout_s)
    return ParallelGroups(layout=layout, dp_group=mesh.dp.get_group(),
                          sp_group=mesh.root.get_group("sp"), world_group=world, mesh=mesh)
