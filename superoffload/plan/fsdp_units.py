"""FSDP2 units: how ``FsdpOffloadEngine`` shards a model, as data (docs/distributed.md, "Data
parallel over FSDP2"; docs/planner.md, "Data parallel").

One rule, applied to modules by the engine (distributed/fsdp/units.py ``shard_model`` calls
``block_units``) and to a ``ModelShape`` by the planner (``plan_units``):

* the blocks are the model's longest ``nn.ModuleList`` (as weight-flow streams them and
  ``ModelShape.from_module`` reads them);
* weight-flow (paper §4.5): one unit per block, its shards on the host (FSDP2's
  ``CPUOffloadPolicy``) and resharded after forward, so it is all-gathered before the
  block's forward and again before its backward;
* weight-stationary (§4.2): consecutive blocks share a unit up to one bucket
  (``bucket_bytes`` of fp32 gradients, 4 B per parameter), filled from the last block as
  ``plan_buckets`` fills buckets in gradient-ready order; a block larger than a bucket is a
  unit alone; a unit keeps its unsharded weights from forward through backward
  (``reshard_after_forward=False``): one all-gather per unit and iteration. A model whose
  parameters fit one bucket has no block units;
* the root (the model itself) takes the rest: embeddings, final norm, head, tied weights.
  FSDP2 never reshards the root after forward, and reduces it last (its post-backward runs
  when the embedding's gradient, the last one backward produces, is final).

Per micro-step FSDP2 all-gathers each unit once (a flow block unit twice) and reduce-scatters
each unit once in its post-backward -- not on a micro-step that only accumulates on the
device (``set_requires_gradient_sync(False)``). A bucket's gradients are complete when the
last unit holding one of its parameters has reduce-scattered (``UnitPlan.buckets_of``).

Pure data in, data out: no torch (docs/conventions.md, "Pure planning core").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from superoffload.config import choices_of
from superoffload.plan.buckets import (
    GRAD_BYTES_PER_PARAM,
    BucketPlan,
    ParamSpec,
    plan_buckets,
    plan_from_groups,
)

ROOT = -1
"""``block_of`` value of a parameter outside the blocks (the root unit holds it)."""
WEIGHT_POLICIES: tuple[str, ...] = choices_of("weights", decided=True)


def group_blocks(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Consecutive blocks (by parameter count) grouped into units of at most one bucket each
    (a block larger than a bucket is a unit by itself), filled from the last block, as the
    planner fills buckets in gradient-ready order (plan/buckets.py)."""
    groups: list[list[int]] = []
    size = 0
    for k in reversed(range(len(numels))):
        if groups and size + numels[k] <= bucket_numel:
            groups[-1].insert(0, k)
            size += numels[k]
        else:
            groups.append([k])
            size = numels[k]
    return groups[::-1]


@dataclass(frozen=True, slots=True)
class BlockUnits:
    """The block units of one model: what ``fully_shard`` is called on, besides the root."""

    groups: tuple[tuple[int, ...], ...]
    """Block indices of each block unit, forward order (empty: the root holds every block)."""
    on_host: bool
    """Weight-flow: the block units' shards live on the host (``CPUOffloadPolicy``)."""
    reshard_after_forward: bool
    """FSDP2 frees a block unit's unsharded weights after its forward (gathered again for
    backward): True under weight-flow, False weight-stationary."""


def block_units(block_numels: Sequence[int], total_numel: int, *, bucket_bytes: int,
                weights: str) -> BlockUnits:
    """The block units for blocks of ``block_numels`` parameters in a model of
    ``total_numel`` (module docstring). ``weights``: "stationary" or "flow"."""
    if weights not in WEIGHT_POLICIES:
        raise ValueError(f"block_units: weights={weights!r}; use one of {WEIGHT_POLICIES} (decide "
                         "'auto' first)")
    if weights == "flow":
        return BlockUnits(tuple((k,) for k in range(len(block_numels))), True, True)
    if total_numel * GRAD_BYTES_PER_PARAM <= bucket_bytes:
        return BlockUnits((), False, False)  # one bucket: the root is the only unit
    groups = group_blocks(block_numels, bucket_bytes // GRAD_BYTES_PER_PARAM)
    return BlockUnits(tuple(tuple(g) for g in groups), False, False)


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One FSDP2 unit as the planner sees it: what one all-gather gathers and one
    reduce-scatter reduces (distributed/fsdp/units.py ``Unit`` holds its modules)."""

    index: int
    """Forward order: 0 is the root (its all-gather opens the forward), then the block units."""
    blocks: tuple[int, ...]
    """Block indices it holds (the root: the blocks no block unit holds, usually none)."""
    param_indices: tuple[int, ...]
    """``ParamSpec.index`` of its trainable parameters, registration order."""
    numel: int
    on_host: bool
    """Its shards live on the host (weight-flow's block units)."""
    reshard_after_forward: bool
    buckets: tuple[int, ...] = ()
    """Ids of the buckets holding its parameters (``UnitPlan.with_buckets``)."""

    @property
    def is_root(self) -> bool:
        return self.index == 0

    @property
    def all_gathers(self) -> int:
        """All-gathers per micro-step: 2 when resharded after forward, else 1."""
        return 2 if self.reshard_after_forward else 1


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """A model's FSDP2 units, forward order (the root first)."""

    units: tuple[UnitSpec, ...]

    def unit_of(self) -> dict[int, int]:
        """``ParamSpec.index`` -> unit index."""
        return {i: u.index for u in self.units for i in u.param_indices}

    def buckets_of(self) -> dict[int, tuple[int, ...]]:
        """Bucket id -> the units holding its parameters, in the order FSDP2 reduces them
        (block units from the last, the root last): the last one completes the bucket."""
        out: dict[int, list[int]] = {}
        for u in sorted(self.units, key=reduce_position):
            for b in u.buckets:
                out.setdefault(b, []).append(u.index)
        return {b: tuple(us) for b, us in sorted(out.items())}

    def with_buckets(self, plan: BucketPlan) -> UnitPlan:
        """The same units, each with the ids of the buckets of ``plan`` holding its params."""
        bucket_of = plan.bucket_of()
        units = tuple(UnitSpec(u.index, u.blocks, u.param_indices, u.numel, u.on_host,
                               u.reshard_after_forward,
                               tuple(sorted({bucket_of[i] for i in u.param_indices
                                         if i in bucket_of})))
                      for u in self.units)
        return UnitPlan(units)

    def table(self) -> list[tuple[int, tuple[int, ...], int, bool, bool, tuple[int, ...]]]:
        """(index, parameter indices, numel, on_host, reshard_after_forward, bucket ids) per
        unit: what tests compare with the engine's units."""
        return [(u.index, u.param_indices, u.numel, u.on_host, u.reshard_after_forward,
                 u.buckets) for u in self.units]

    def collectives(self, *, micro_steps: int = 1,
                    reduce_every_micro_step: bool = False) -> tuple[int, int]:
        """(all-gathers, reduce-scatters) FSDP2 issues in one optimizer step of
        ``micro_steps`` micro-steps: every micro-step gathers; gradients are reduce-scattered
        on the last micro-step only, unless every micro-step reduces (accumulation on the
        host: each micro-step's shards leave)."""
        gathers = micro_steps * sum(u.all_gathers for u in self.units)
        # without reduce_every_micro_step, FSDP2's no-sync keeps gradients until the last
        reduces = (micro_steps if reduce_every_micro_step else 1) * len(self.units)
        return gathers, reduces


def reduce_position(unit: UnitSpec) -> tuple[int, int]:
    """Sort key of the order FSDP2 reduce-scatters units in backward: block units from the
    last block down, the root last."""
    if unit.is_root:
        # the root's post-backward runs after every block's
        return (1, 0)
    # a unit's reduce-scatter follows the backward of its first (lowest) block
    return (0, -min(unit.blocks, default=0))


def plan_units(params: Sequence[ParamSpec], block_of: Sequence[int], *, bucket_bytes: int,
               weights: str, block_numels: Sequence[int] | None = None,
               total_numel: int | None = None, bucket_plan: BucketPlan | None = None
               ) -> UnitPlan:
    """The units of a model whose trainable ``params`` (registration order) lie in blocks
    ``block_of`` (one per param: its block index, or ``ROOT``). ``block_numels`` /
    ``total_numel``: what the grouping counts (default: the trainable parameters, as the
    planner knows them; the engine counts every parameter of a block, frozen ones too).
    ``bucket_plan``: fill in each unit's buckets."""
    if len(block_of) != len(params):
        raise ValueError(f"plan_units: {len(block_of)} block indices for {len(params)} "
                         "parameters; give one per parameter")
    n_blocks = max((b for b in block_of if b != ROOT), default=-1) + 1
    if block_numels is None:
        sizes = [0] * n_blocks
        for spec, b in zip(params, block_of):
            if b != ROOT:
                sizes[b] += spec.numel
        block_numels = sizes
    if total_numel is None:
        total_numel = sum(s.numel for s in params)
    bu = block_units(block_numels, total_numel, bucket_bytes=bucket_bytes, weights=weights)
    # unit 0 is the root; block units are numbered from 1 in forward order
    unit_of_block = {k: u + 1 for u, group in enumerate(bu.groups) for k in group}
    members: list[list[ParamSpec]] = [[] for _ in range(len(bu.groups) + 1)]
    for spec, b in zip(params, block_of):
        # outside the blocks, or in a block no unit took: the root holds it
        unit = unit_of_block.get(b, 0) if b != ROOT else 0
        members[unit].append(spec)
    root_blocks = tuple(k for k in range(len(block_numels)) if k not in unit_of_block)
    # FSDP2 never reshards the root after forward, and it stays on the device
    units = [UnitSpec(0, root_blocks, tuple(s.index for s in members[0]),
                      sum(s.numel for s in members[0]), False, False)]
    units += [UnitSpec(u + 1, group, tuple(s.index for s in members[u + 1]),
                       sum(s.numel for s in members[u + 1]), bu.on_host, bu.reshard_after_forward)
              for u, group in enumerate(bu.groups)]
    out = UnitPlan(tuple(units))
    return out.with_buckets(bucket_plan) if bucket_plan is not None else out


def unit_buckets(params: Sequence[ParamSpec], unit_params: Sequence[Sequence[int]], *,
                 bucket_bytes: int, ratio: float, merge_small: bool = True) -> BucketPlan:
    """Buckets that follow the FSDP2 units (``EngineVariant.buckets_per_unit``): no bucket
    crosses a unit, so each completes at one reduce-scatter; a unit of at most one bucket
    (the grouping makes most of them so) is one bucket, a larger one is cut as
    ``plan_buckets`` cuts a model. Bucket ids follow the order FSDP2 reduces the units (block
    units from the last, the root last), so earliest-deadline-first steps the root's buckets
    first: the root's all-gather opens the next forward. ``unit_params``: each unit's
    parameter indices, forward order, the root first (``UnitPlan`` or the engine's units);
    ``ratio`` offloads the leading buckets as ``plan_buckets`` does."""
    by_index = {s.index: s for s in params}
    covered = {i for ids in unit_params for i in ids}
    missing = [s.name or s.index for s in params if s.index not in covered]
    if missing:
        raise ValueError(f"unit_buckets: parameters {missing[:3]} are in no FSDP2 unit; give "
                         "every trainable parameter's unit")
    groups: list[list[ParamSpec]] = []
    for u in [*range(len(unit_params) - 1, 0, -1), 0]:  # FSDP2's reduce order
        members = [by_index[i] for i in sorted(unit_params[u]) if i in by_index]
        cut = plan_buckets(members, bucket_bytes=bucket_bytes, ratio=1.0,
                           merge_small=merge_small)
        groups += [[by_index[i] for i in b.param_indices] for b in cut.buckets]
    return plan_from_groups(groups, bucket_bytes=bucket_bytes, ratio=ratio)
