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

from superoffload.runtime.backend import GradStats
from superoffload.runtime.scheduler import Flight, IterationScheduler
from superoffload.runtime.steps import device_step, make_calls
from superoffload.runtime.stv import Action, Verdict, verdict
from superoffload.runtime.transport import GlobalStats
from superoffload.telemetry.events import KIND_VALIDATE, LANE_COMPUTE


def finish_iteration(sched: IterationScheduler) -> Verdict:
    """Validate, settle every bucket, step the tail, close the iteration."""
    it = sched.current
    flights = [it.flights[b] for b in sorted(it.flights)]
    loss_scale = sched.scaler.loss_scale
    v, glob = validate(sched, flights, loss_scale)
    it.settling = True  # from here an interruption leaves the iteration half-settled
    settle(sched, flights, v, glob)
    if v.action is not Action.SKIP:
        sched.state.take_steps(sorted(glob.present))
    close_iteration(sched, v, loss_scale)
    return v


def validate(sched: IterationScheduler, flights: list[Flight],
             loss_scale: float) -> tuple[Verdict, GlobalStats]:
    rec, t0 = sched.recorder, sched.recorder.now()
    local = sched.transport.tail_stats([fl.bucket for fl in flights if fl.on_device])
    sum_sq, nonfinite = local.sum_sq, local.nonfinite
    for fl in flights:
        if fl.on_device or fl.stats is None:
            continue
        stats = sched.wait(fl.stats, f"gradients of bucket {fl.bucket}").resolve()
        if stats.nonfinite:
            sched.stats.nonfinite_buckets += 1
        sum_sq += stats.sum_sq
        nonfinite += stats.nonfinite
    present = frozenset().union(*(fl.present for fl in flights))
    glob = sched.transport.reduce_stats(GradStats(sum_sq, nonfinite), present)
    n = sched.transport.grad_divisor
    v = verdict(glob.sum_sq / n**2, glob.nonfinite, loss_scale=loss_scale,
                max_grad_norm=sched.config().max_grad_norm)
    rec.add(LANE_COMPUTE, KIND_VALIDATE, t0, rec.now(), iteration=sched.iteration)
    return v, glob


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
                                            speculative=False, replay=replay),
                            fl.bucket, after=() if undone is None else (undone,))
        if replay:
            step.add_done_callback(sched.counter("replays"))
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
    rec.scalar("loss_scale", n, loss_scale)
    schedule = sched.state.schedule
    rec.scalar("ratio", n, schedule.ratio if schedule is not None else 0.0)  # effective ratio
    rec.scalar("speculating", n, 1.0 if it.speculate else 0.0)
    rec.scalar("skipped", n, 1.0 if skipped else 0.0)  # the dashboard marks skipped steps
    sched.iteration += 1
