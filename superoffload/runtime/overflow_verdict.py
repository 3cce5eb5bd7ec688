"""Validation's part of the non-finite-state rule (runtime/state_overflow.py): a bucket whose
step would make p, m or v non-finite adds to the iteration's non-finite count, so the verdict
skips the step on every rank and rolls back, as for a non-finite gradient (paper §4.3).

Called by ``settle.validate`` per bucket; it does nothing unless the bucket's statistics allow
an overflow (``may_overflow``): then it reads the speculative step's answer (that step tried
before writing) or tries the bucket itself on copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from superoffload.runtime.state_overflow import StateOverflow, clipped_safely, may_overflow, trial
from superoffload.runtime.steps import sr_seed

if TYPE_CHECKING:
    from superoffload.runtime.iteration import Flight
    from superoffload.runtime.scheduler import IterationScheduler


def _report(sched: IterationScheduler, bucket: int, bad: int) -> int:
    sched.stats.nonfinite_buckets += 1
    sched.recorder.note(sched.iteration, (
        f"bucket {bucket}: the step would make {bad} element(s) of the optimizer state "
        "non-finite (exp_avg_sq = (1-b2) g^2 overflows fp32): counted as a non-finite step, "
        "skipped and rolled back like a non-finite gradient"))
    return bad


def host_bucket(sched: IterationScheduler, fl: Flight, sum_sq: float,
                clip: float | None) -> int:
    """Validation of one offloaded bucket (its gradient finite): the number of non-finite
    values its step would write, 0 in any sane run (``may_overflow`` says no)."""
    hypers = [c.hyper for c in fl.calls]
    scale = 1.0 / (sched.scaler.loss_scale * sched.transport.grad_divisor)
    if not hypers or not may_overflow(sum_sq, scale, hypers) \
            or clipped_safely(sum_sq, scale, hypers, clip):
        return 0
    if fl.spec is not None:  # it tried before writing anything (StepTask.run)
        result: Any = sched.wait(fl.spec, f"speculative step of bucket {fl.bucket}")
        bad = result.elements if isinstance(result, StateOverflow) else 0
    else:
        buf = sched.state.buffers[fl.bucket]
        seed = sched.config().seed
        bad = trial(buf, fl.calls, buf.grad_host, grad_scale=scale, threads=sched.threads,
                    seeds=[sr_seed(seed, buf.bucket.id, c.step, k) for k, c in enumerate(fl.calls)])
    return _report(sched, fl.bucket, bad) if bad else 0


def tail_buckets(sched: IterationScheduler, flights: Sequence[Flight], sum_sq: float,
                 clip: float | None) -> int:
    """The same for the GPU tail buckets, whose statistics come summed (``sum_sq``)."""
    hypers = [c.hyper for fl in flights for c in fl.calls]
    scale = 1.0 / (sched.scaler.loss_scale * sched.transport.grad_divisor)
    if not hypers or not may_overflow(sum_sq, scale, hypers) \
            or clipped_safely(sum_sq, scale, hypers, clip):
        return 0
    total = 0
    for fl in flights:
        if not fl.calls:
            continue
        buf = sched.state.buffers[fl.bucket]
        bad = trial(buf, fl.calls, sched.transport.tail_grads(fl.bucket), grad_scale=scale,
                    threads=None,  # device_step's calls run with seed 0
                    seeds=[sr_seed(0, buf.bucket.id, c.step, k) for k, c in enumerate(fl.calls)])
        total += _report(sched, fl.bucket, bad) if bad else 0
    return total
