"""Validate and settle one iteration: steps 2-3 of the bucket lifecycle (paper §4.3 STV).

``finish_iteration`` (called by ``step()``):

1. validate: the tail buckets' and every host bucket's local statistics are summed and the
   transport reduces them over the ranks (ZeRO: one all-reduce; partials are disjoint, so
   the sum is exact), together with which parameters got a gradient anywhere; the verdict
   (``stv.verdict``) is the same on every rank;
2. settle each bucket: COMMIT keeps the speculative steps (buckets not speculated step now);
   CLIP rolls them back and replays them with the clipped gradient still in the host
   buffer; SKIP rolls back and publishes the restored weights. A bucket whose parameters
   got gradients on another rank but not here (ZeRO) is rolled back and stepped with the
   union, as DDP averages a gradient unused on one rank; every rank then publishes it once
   more (collectives must match), the others from their own step;
3. the GPU tail buckets step on the device with the verdict's factor; every parameter with
   a gradient somewhere takes one step (the others are untouched, as ``torch.optim`` skips
   ``grad is None``); then the loss scaler, adaptive STV, counters and telemetry.

Gradients arrive summed over ``transport.grad_divisor`` ranks: the squared norm is divided by
N^2 and the kernel's factor carries 1/N.
"""

from __future__ import annotations

import math

from superoffload.runtime.backend import GradStats
from superoffload.runtime.guard import RanksDisagree, hyper_hash, hyper_tuple
from superoffload.runtime.overflow_verdict import host_bucket, tail_buckets
from superoffload.runtime.scheduler import Flight, IterationScheduler
from superoffload.runtime.steps import device_step, make_calls
from superoffload.runtime.stv import Action, Verdict, verdict
from superoffload.runtime.transport import Checks, GlobalStats
from superoffload.telemetry.events import KIND_VALIDATE, LANE_COMPUTE


def finish_iteration(sched: IterationScheduler) -> Verdict:
    """Validate, settle every bucket, step the tail, close the iteration. A broken contract
    (an edited gradient, ranks that disagree) raises a ``ContractError`` before anything is
    settled, the same on every rank: the caller rolls the iteration back."""
    it = sched.current
    flights = [it.flights[b] for b in sorted(it.flights)]
    loss_scale = sched.scaler.loss_scale
    glob = it.validated
    if glob is None:
        glob = validate(sched, flights)
    else:  # clip_grad_norm_ validated already: only the edits since then are left to agree
        glob = check_again(sched, glob)
    v = decide(sched, glob, loss_scale)
    it.settling = True  # from here an interruption leaves the iteration half-settled
    settle(sched, flights, v, glob)
    if v.action is not Action.SKIP:
        sched.state.take_steps(sorted(glob.present))
    close_iteration(sched, v, loss_scale)
    return v


def checks(sched: IterationScheduler) -> Checks:
    """This rank's contract checks for the validation reduce (runtime/guard.py)."""
    it, cfg = sched.current, sched.config()
    return Checks(edited=bool(sched.contract.edited()),
                  hyper_hash=hyper_hash(it.hypers, cfg.max_grad_norm))


def validate(sched: IterationScheduler, flights: list[Flight]) -> GlobalStats:
    """Sum the local statistics of every bucket and rank (one reduce, ``checks`` with them)."""
    rec, t0 = sched.recorder, sched.recorder.now()
    local = sched.transport.tail_stats([fl.bucket for fl in flights if fl.on_device])
    sum_sq, nonfinite = local.sum_sq, local.nonfinite
    for fl in flights:
        if fl.on_device or fl.stats is None:
            continue
        stats = sched.wait(fl.stats, f"gradients of bucket {fl.bucket}").resolve()
        if stats.nonfinite:
            sched.stats.nonfinite_buckets += 1
        else:  # a step that would write a non-finite state is a non-finite step too
            nonfinite += host_bucket(sched, fl, stats.sum_sq, clip_threshold(sched))
        sum_sq += stats.sum_sq
        nonfinite += stats.nonfinite
    if not local.nonfinite:
        nonfinite += tail_buckets(sched, [fl for fl in flights if fl.on_device], local.sum_sq,
                                  clip_threshold(sched))
    present = frozenset().union(*(fl.present for fl in flights))
    glob = sched.transport.reduce_stats(GradStats(sum_sq, nonfinite), present, checks(sched))
    rec.add(LANE_COMPUTE, KIND_VALIDATE, t0, rec.now(), iteration=sched.iteration)
    enforce(sched, glob)
    return glob


def check_again(sched: IterationScheduler, glob: GlobalStats) -> GlobalStats:
    """After an early validation: the edits made since, agreed over the ranks."""
    again = sched.transport.reduce_stats(GradStats(0.0, 0), frozenset(), checks(sched))
    enforce(sched, again)
    return glob


def enforce(sched: IterationScheduler, glob: GlobalStats) -> None:
    if glob.edited:
        names = sched.contract.edited()
        if not names:  # edited on another rank only
            names = [f"<on {glob.edited} other rank(s)>"]
        raise sched.contract.edit_error(names)
    if not glob.agree:  # name the field: every rank saw the mismatch, so all join this
        it = sched.current
        sched.transport.agree({"param_groups": [hyper_tuple(h) for h in it.hypers],
                               "max_grad_norm": sched.config().max_grad_norm})
        raise RanksDisagree("data-parallel ranks step with different hyper-parameters")


def validate_early(sched: IterationScheduler, max_norm: float | None) -> tuple[float, int]:
    """``engine.clip_grad_norm_`` / ``engine.grad_norm``: validate now (every bucket's
    statistics, every rank), keep the result for ``step()``, lower the iteration's threshold
    to ``max_norm`` (None: read only). Returns (total norm of the unscaled gradient,
    non-finite count)."""
    it = sched.current
    if max_norm is not None:  # first: validation knows the step will be clipped
        it.clip_norm = max_norm if it.clip_norm is None else min(it.clip_norm, max_norm)
    if it.validated is None:
        it.validated = validate(sched, [it.flights[b] for b in sorted(it.flights)])
    glob, n = it.validated, sched.transport.grad_divisor
    if glob.nonfinite or not math.isfinite(glob.sum_sq):
        return math.inf, max(glob.nonfinite, 1)
    return math.sqrt(glob.sum_sq / n**2) / sched.scaler.loss_scale, 0


def clip_threshold(sched: IterationScheduler) -> float | None:
    """The iteration's clipping threshold: the configured one and ``clip_grad_norm_``'s, the
    smaller (clipping twice clips to the smaller norm)."""
    given = [x for x in (sched.config().max_grad_norm, sched.current.clip_norm) if x]
    return min(given) if given else None


def decide(sched: IterationScheduler, glob: GlobalStats, loss_scale: float) -> Verdict:
    n = sched.transport.grad_divisor
    return verdict(glob.sum_sq / n**2, glob.nonfinite, loss_scale=loss_scale,
                   max_grad_norm=clip_threshold(sched))


def settle(sched: IterationScheduler, flights: list[Flight], v: Verdict,
           glob: GlobalStats) -> None:
    st, it = sched.state, sched.current
    scale = v.grad_scale / sched.transport.grad_divisor
    collective = sched.transport.ordered_launch
    # forward-need order: the highest bucket ids (first layers) first, tail steps included
    for fl in sorted(flights, key=lambda f: -f.bucket):
        buf = st.buffers[fl.bucket]
        union = glob.present & frozenset(sched.bucket_params(fl.bucket))
        if fl.on_device:
            if v.action is not Action.SKIP and union:
                calls = make_calls(buf, union, st.group_of, st.steps, it.hypers)
                device_step(buf, calls, sched.transport.tail_grads(fl.bucket),
                            grad_scale=scale, threads=None, recorder=sched.recorder,
                            iteration=sched.iteration)
            continue
        mismatch = union != fl.present
        undone = None
        if fl.spec is not None and (v.action is not Action.COMMIT or mismatch):
            undone = sched.rollback(fl)
            if v.action is Action.SKIP:
                sched.publish(fl.bucket, fl.calls, undone)  # the restored weights
        if v.action is Action.SKIP:
            continue
        if not (fl.spec is None or v.action is Action.CLIP or mismatch):
            if fl.spec is not None and union & glob.partial:
                sched.publish(fl.bucket, fl.calls, fl.spec)  # match the replaying ranks
            continue
        calls = make_calls(buf, union, st.group_of, st.steps, it.hypers) if mismatch else fl.calls
        if not calls and not collective:
            continue
        replay = fl.spec is not None
        step = sched.submit(sched.step_task(fl, calls, scale=scale, after=None,
                                            speculative=False, replay=replay, undone=undone),
                            fl.bucket, after=() if undone is None else (undone,))
        if replay:  # counted only when the speculative step had run and was undone
            step.add_done_callback(sched.counter("replays", when=undone))
        sched.publish(fl.bucket, calls, step)


def close_iteration(sched: IterationScheduler, v: Verdict, loss_scale: float) -> None:
    """Loss scaler, counters, adaptive STV, telemetry scalars and notes; every rank holds the
    same verdict, so an overflow skips the step everywhere. ``loss_scale``: the scale this
    iteration ran with (before the update)."""
    it, rec, n, stats = sched.current, sched.recorder, sched.iteration, sched.stats
    skipped = v.action is Action.SKIP
    sched.scaler.update(skipped)
    if skipped:
        stats.skipped_steps += 1
        where = (f"on some rank: step skipped on all {sched.transport.grad_divisor} ranks"
                 if sched.transport.grad_divisor > 1 else ": step skipped")
        rec.note(n, f"overflow: non-finite gradient{where}; loss scale {loss_scale:g} -> "
                    f"{sched.scaler.loss_scale:g}")
    if v.action is Action.CLIP:
        stats.clipped_steps += 1
    note = sched.adaptive.observe(v.action is Action.CLIP)
    if note:
        rec.note(n, note)
    stats.speculation_enabled = sched.adaptive.enabled
    stats.iterations += 1
    if it.losses:  # the only host sync for the loss: after the step, not inside backward
        rec.scalar("loss", n, float(sum(float(x) for x in it.losses) / len(it.losses)))
    rec.scalar("grad_norm", n, v.grad_norm)
    sched.last_grad_norm = v.grad_norm
    rec.scalar("loss_scale", n, loss_scale)
    schedule = sched.state.schedule
    rec.scalar("ratio", n, schedule.ratio if schedule is not None else 0.0)  # effective ratio
    rec.scalar("speculating", n, 1.0 if it.speculate else 0.0)
    rec.scalar("skipped", n, 1.0 if skipped else 0.0)  # the dashboard marks skipped steps
    sched.iteration += 1
