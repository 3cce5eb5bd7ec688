"""`train` under torchrun: data parallel over FSDP2 and Ulysses sequence parallel
(docs/distributed.md). Each helper here is a collective unless it says otherwise: every rank
calls it at the same point of the run, in the same order.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from superoffload.commands.train_args import UsageError


def start(args: argparse.Namespace) -> Any:
    """init_distributed() when launched by torchrun or asked for --dp/--sp > 1; else None."""
    if "WORLD_SIZE" not in os.environ and (args.dp or 1) == 1 and args.sp == 1:
        return None
    from superoffload.distributed import init_from_args

    try:
        return init_from_args(args)
    except ValueError as exc:
        # --dp x --sp not matching the launched processes
        raise UsageError(str(exc)) from None


def make_engine(model: torch.nn.Module, groups: list[dict[str, Any]], config: Any) -> Any:
    """The data-parallel engine: the offload engine over FSDP2, which shards the model over
    the job's mesh (distributed/mesh.py: every dp*sp rank holds a shard; HSDP replicas with
    --dp-replicate). The model's parameters become DTensor shards."""
    from superoffload.distributed.fsdp import FsdpOffloadEngine

    return FsdpOffloadEngine(model, groups, config)


def make_sequence_parallel(model: torch.nn.Module, sp: int, seq: int) -> None:
    """Ulysses attention over this rank's sp group (docs/distributed.md, "dp x sp")."""
    from superoffload.distributed import apply_ulysses, get_groups
    from superoffload.models import GPT

    if seq % sp:
        raise UsageError(f"--seq={seq} is not divisible by --sp={sp}: use a multiple of {sp}")
    if not isinstance(model, GPT):
        raise UsageError("--sp > 1: sequence parallel is wired for our GPT only")
    try:
        apply_ulysses(model, get_groups().sp_group)
    except ValueError as exc:
        # heads not divisible by sp
        raise UsageError(f"--sp {sp}: {exc}") from None


class SequenceShard:
    """A batch sampler yielding this rank's contiguous 1/sp slice of every sequence (targets
    are already shifted by the sampler, so no target lies on another rank). Not collective."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        from superoffload.distributed import get_groups, split_sequence

        x, y = self.inner.next_batch()
        sp_group = get_groups().sp_group
        return split_sequence(x, sp_group), split_sequence(y, sp_group)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.inner.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def global_mean(loss: Any) -> Any:
    """The mean loss over every rank (equal token counts: the global-batch mean)."""
    from superoffload.distributed import get_groups, mean_over_group

    return mean_over_group(loss, get_groups().world_group)


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any (a stop request seen by one rank)."""
    import torch.distributed as dist

    from superoffload.distributed import get_groups

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    group = get_groups().world_group
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def max_over_ranks(value: int) -> int:
    """The largest of every rank's `value` (which signal stopped the job)."""
    import torch.distributed as dist

    from superoffload.distributed import get_groups

    t = torch.tensor([value], dtype=torch.int64)
    group = get_groups().world_group
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, by global rank, on every rank (sampler states for a checkpoint)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shared_out_dir(out: Path | None, error: str | None) -> Path:
    """Rank 0's output folder (or the reason it could not make one), told to every rank, so
    a bad --out ends every rank with the same one-line error instead of a hang."""
    import torch.distributed as dist

    box: list[Any] = [None if out is None else str(out), error]
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise UsageError(box[1])
    return Path(box[0])


@dataclass(frozen=True, slots=True)
class RankClock:
    """Where a rank's recorder started: its host, on that host's perf_counter and on the
    wall clock (time.time at the same instant)."""

    host: str
    origin_perf_s: float
    origin_wall_s: float

    @classmethod
    def of(cls, recorder: Any) -> RankClock:
        now_perf, now_wall = time.perf_counter(), time.time()
        origin = recorder.origin_perf_counter_s
        return cls(socket.gethostname(), origin, now_wall - (now_perf - origin))


def clock_offsets(clocks: list[RankClock], lead: RankClock) -> list[float]:
    """Seconds from ``lead``'s origin to each rank's: by perf_counter on the lead's host
    (exact: one system-wide clock there), by the wall clock across hosts (perf_counter
    epochs of two hosts are unrelated; NTP keeps wall clocks within milliseconds)."""
    out = []
    for c in clocks:
        if c.host == lead.host:
            out.append(c.origin_perf_s - lead.origin_perf_s)
        else:
            out.append(c.origin_wall_s - lead.origin_wall_s)
    return out


def gather_rank_spans(spans: list[Any], recorder: Any) -> list[Any]:
    """Every rank's spans on rank 0, on rank 0's clock (other ranks get their own back);
    clocks aligned by ``clock_offsets`` (several hosts: by their wall clocks)."""
    import torch.distributed as dist

    from superoffload.telemetry.ranks import merge_rank_spans

    mine = (dist.get_rank(), RankClock.of(recorder), spans)
    # gather_object wants the receiving list on the destination only
    if dist.get_rank() != 0:
        dist.gather_object(mine, None, dst=0)
        return spans
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, gathered, dst=0)
    return merge_rank_spans([g[2] for g in gathered], ranks=[g[0] for g in gathered],
                            offsets_s=clock_offsets([g[1] for g in gathered], mine[1]))
