"""A storage-tier bucket's state outside a step: read (an export, a checkpoint, a gradient
asked for), changed (adopted weights) or written whole (building the tier, a load), each
through a pool slot and synchronously (runtime/tier.py; the engine is synchronized).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from superoffload.runtime.engine_state import BucketBuffers, ParamState
from superoffload.runtime.tier import StateTier, StorageTierError


@contextmanager
def loaded(tier: StateTier, b: int, *, write: bool, grad: bool = False,
           cast_lp: bool = False) -> Iterator[BucketBuffers]:
    """Bucket ``b``'s state in force in a slot; ``write``: the changes made in the block
    become the version in force; ``grad``: the spilled gradient is read too; ``cast_lp``:
    the low-precision copy is made from the master."""
    fut = tier.bind(b, grad=grad, cast_lp=cast_lp)
    assert fut is not None
    try:
        fut.result(timeout=tier.watchdog_s)
        yield tier.buffers[b]
    finally:
        done = tier.finish(b, after=(), step=None, state=write, grad=False, published=None,
                           speculative=False)
        done.result(timeout=tier.watchdog_s)


def read_grad(tier: StateTier, b: int, position: int) -> torch.Tensor:
    """Parameter ``position`` of bucket ``b``'s gradient of this iteration, read back from
    the file (a copy; ``engine.full_grad``)."""
    tier.wait_written(b)
    if not tier.grad_spilled(b):
        raise StorageTierError(
            f"storage tier: bucket {b} holds no gradient of this iteration (it has not left "
            "the device yet, or the iteration was undone)")
    with loaded(tier, b, write=False, grad=True) as buf:
        return buf.grad_host[position].clone()


def export(tier: StateTier, b: int, steps: Sequence[int]) -> list[ParamState]:
    """Placement-free copies (CPU, fp32) of bucket ``b``'s state in force."""
    with loaded(tier, b, write=False) as buf:
        return [ParamState(buf.master[i].detach().to(torch.float32, copy=True),
                           buf.exp_avg[i].detach().to(torch.float32, copy=True),
                           buf.exp_avg_sq[i].detach().to(torch.float32, copy=True),
                           int(steps[i])) for i in range(len(buf.params))]


def fill(tier: StateTier, b: int, states: Sequence[ParamState]) -> None:
    """Write ``states`` as bucket ``b``'s state in force (building the tier, a load); the
    write runs on while the next bucket is filled (memory bounded by the pool)."""
    tier.bind(b, read=False)
    buf = tier.buffers[b]
    # weight-flow: the home (in memory, or the state's copy in the file) holds the weights
    homed = tier.books[b].home is not None or tier.home_in_file(b)
    with torch.no_grad():
        for i, st in enumerate(states):
            buf.master[i].copy_(st.master)
            buf.exp_avg[i].copy_(st.exp_avg)
            buf.exp_avg_sq[i].copy_(st.exp_avg_sq)
        for d, p in zip((buf.lp_host or []) if homed else [], buf.params):
            d.copy_(p.data)
    tier.finish(b, after=(), step=None, state=True, grad=False, published=None,
                speculative=False)
