"""Speculation-then-validation: validate, decide, settle, close (paper §4.3; DESIGN.md §3).

The CPU steps each offloaded bucket before the global gradient norm and the inf/nan verdict
are known (runtime/launch.py). ``OffloadOptimizer.step`` (runtime/optimizer.py) then runs, in
this order:

1. ``validate``: the tail buckets' and every host bucket's local statistics are summed and the
   transport reduces them over the ranks (FSDP2: one all-reduce; shards are disjoint, so the
   sum is exact), together with which parameters got a gradient anywhere and the contract's
   checks (an edited gradient, ranks that disagree: a ``ContractError`` before anything is
   settled, the same on every rank). A bucket whose step would make the optimizer state
   non-finite counts as non-finite (runtime/state_overflow.py);
2. ``decide``: ``verdict`` (pure): COMMIT, CLIP or SKIP, the same on every rank;
3. ``settle`` each bucket: COMMIT keeps the speculative steps (buckets not speculated step
   now); CLIP rolls them back and replays them with the clipped gradient still in the host
   buffer; SKIP rolls back and publishes the restored weights. A bucket whose parameters got
   gradients on another rank but not here is rolled back and stepped with the union, as DDP
   averages a gradient unused on one rank. The GPU tail buckets step on the device with the
   verdict's factor; every parameter with a gradient somewhere takes one step (the others are
   untouched, as ``torch.optim`` skips ``grad is None``);
4. ``close_iteration``: step counts, the loss scaler, adaptive STV, counters and telemetry;
   steps skipped in a row for another reason than fp16's loss scale are said out loud, with
   the buckets that stopped them (runtime/skips.py).

``abort`` undoes an iteration that will not finish; ``validate_early`` serves
``clip_grad_norm_``/``grad_norm``/``full_grad`` between the last backward and ``step()``;
``AdaptiveSTV`` decides, iteration by iteration, whether to speculate at all. Gradients arrive
summed over ``transport.grad_divisor`` ranks: the squared norm is divided by N^2 and the
kernel's factor carries 1/N. Every phase takes the iteration (``it``, its frozen settings) and
the engine's ``Parts``, and returns its result.

Past 400 lines: one concept, the protocol of paper §4.3 from validation to the close, with
the reads of the validated gradient (``clip_grad_norm_``, ``grad_norm``, ``full_grad``) and
the two decisions it rests on (the pure verdict, adaptive STV).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from superoffload.runtime import skips, tier_access, tier_steps
from superoffload.runtime.contract import RanksDisagree, hyper_hash, hyper_tuple
from superoffload.runtime.devices import GradStats
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.iteration import Flight, Iteration, Parts
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.state_overflow import StateOverflow, clipped_safely, may_overflow, trial
from superoffload.runtime.steps import device_step, make_calls, rollback_task, sr_seed, step_task
from superoffload.runtime.transport import Checks, GlobalStats
from superoffload.telemetry.events import KIND_VALIDATE, LANE_COMPUTE


class Action(Enum):
    COMMIT = "commit"
    """Every speculative step stands."""
    CLIP = "clip"
    """Roll speculative steps back and replay them with the clipped gradient."""
    SKIP = "skip"
    """Overflow: roll back and skip the step (fp16 shrinks the loss scale)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    grad_norm: float
    """Global norm of the unscaled gradient (inf/nan on overflow)."""
    grad_scale: float
    """Factor the kernel applies to the stored (loss-scaled) gradient: clip / loss_scale."""


def verdict(
    sum_sq_scaled: float, nonfinite: int, *, loss_scale: float, max_grad_norm: float | None
) -> Verdict:
    """Decide the iteration from the summed local statistics."""
    # finite gradients whose squares sum past the float range overflow too: either one skips
    if nonfinite or not math.isfinite(sum_sq_scaled):
        return Verdict(Action.SKIP, math.inf, 0.0)
    # the stored gradient carries the loss scale (fp16); the norm is the unscaled one
    norm = math.sqrt(sum_sq_scaled) / loss_scale
    unscale = 1.0 / loss_scale
    if max_grad_norm:
        # torch.nn.utils.clip_grad_norm_'s coefficient, its 1e-6 included (PyTorch docs), so
        # a clipped run matches a plain torch loop to the last bit
        coef = max_grad_norm / (norm + 1e-6)
        # as torch: applied only when it shrinks the gradient
        if coef < 1.0:
            return Verdict(Action.CLIP, norm, coef * unscale)
    return Verdict(Action.COMMIT, norm, unscale)


# ---------------------------------------------------------------------------- 1. validate
def flights_of(it: Iteration) -> list[Flight]:
    """The iteration's launched buckets, in bucket order."""
    return [it.flights[b] for b in sorted(it.flights)]


def validate(it: Iteration, parts: Parts) -> GlobalStats:
    """Sum the local statistics of every bucket and rank (one reduce, the contract's checks
    with them); raise a ``ContractError`` for an edited gradient or ranks that disagree."""
    rec, frozen, transport = parts.recorder, it.frozen, parts.transport
    t0 = rec.now()
    flights = flights_of(it)
    # the GPU tail buckets' statistics come summed in one device reduction (no host sync each)
    local = transport.tail_stats([fl.bucket for fl in flights if fl.on_device])
    sum_sq, nonfinite = local.sum_sq, local.nonfinite
    clip = clip_threshold(it)
    for fl in flights:
        if fl.on_device or fl.stats is None:
            continue
        stats = parts.in_flight.wait(fl.stats, f"gradients of bucket {fl.bucket}",
                                     frozen.config.watchdog_s).resolve()
        if stats.nonfinite:
            parts.stats.nonfinite_buckets += 1
            it.skip_causes.append(cause(parts, skips.GRADIENT, fl.bucket))
        else:
            # a step that would write a non-finite state is a non-finite step too
            nonfinite += host_overflow(it, parts, fl, stats.sum_sq, clip)
        sum_sq += stats.sum_sq
        nonfinite += stats.nonfinite
    if not local.nonfinite:
        nonfinite += tail_overflow(it, parts, [fl for fl in flights if fl.on_device],
                                   local.sum_sq, clip)
    else:
        # which tail buckets: one reduction each, paid only on a non-finite step
        it.skip_causes += [cause(parts, skips.GRADIENT, fl.bucket) for fl in flights
                           if fl.on_device and transport.tail_stats([fl.bucket]).nonfinite]
    # the union over ranks of who got a gradient travels with the sums (settle's replays)
    present = frozenset().union(*(fl.present for fl in flights))
    glob = transport.reduce_stats(GradStats(sum_sq, nonfinite), present, checks(it, parts))
    rec.add(LANE_COMPUTE, KIND_VALIDATE, t0, rec.now(), iteration=frozen.number)
    enforce(it, parts, glob)
    return glob


def check_again(it: Iteration, parts: Parts, glob: GlobalStats) -> GlobalStats:
    """After an early validation: the edits made since, agreed over the ranks."""
    again = parts.transport.reduce_stats(GradStats(0.0, 0), frozenset(), checks(it, parts))
    enforce(it, parts, again)
    return glob


def checks(it: Iteration, parts: Parts) -> Checks:
    """This rank's contract checks for the validation reduce (runtime/contract.py)."""
    frozen = it.frozen
    return Checks(edited=bool(parts.contract.edited()),
                  hyper_hash=hyper_hash(frozen.hypers, frozen.config.max_grad_norm))


def enforce(it: Iteration, parts: Parts, glob: GlobalStats) -> None:
    if glob.edited:
        names = parts.contract.edited()
        if not names:
            # edited on another rank only: every rank raises, this one names the count
            names = [f"<on {glob.edited} other rank(s)>"]
        raise parts.contract.edit_error(names)
    # name the field: every rank saw the mismatch, so all join this second collective
    if not glob.agree:
        frozen = it.frozen
        parts.transport.agree({"param_groups": [hyper_tuple(h) for h in frozen.hypers],
                               "max_grad_norm": frozen.config.max_grad_norm})
        raise RanksDisagree("data-parallel ranks step with different hyper-parameters")


def host_overflow(it: Iteration, parts: Parts, fl: Flight, sum_sq: float,
                  clip: float | None) -> int:
    """An offloaded bucket (its gradient finite): the number of non-finite values its step
    would write, 0 in any sane run (``may_overflow`` says no). The speculative step tried
    before writing; a bucket not speculated is tried on copies (runtime/state_overflow.py)."""
    hypers, frozen = [c.hyper for c in fl.calls], it.frozen
    # the stored gradient is loss-scaled and summed over the ranks: the kernel's own factor
    scale = 1.0 / (frozen.loss_scale * parts.transport.grad_divisor)
    # the cheap bound first (state_overflow.py): a trial step only where it could overflow
    if not hypers or not may_overflow(sum_sq, scale, hypers) \
            or clipped_safely(sum_sq, scale, hypers, clip):
        return 0
    if fl.spec is not None:
        # the speculative step tried before writing anything (StepTask.run): its answer stands
        result: Any = parts.in_flight.wait(fl.spec, f"speculative step of bucket {fl.bucket}",
                                           frozen.config.watchdog_s)
        bad = result.elements if isinstance(result, StateOverflow) else 0
    else:
        tier, seed = parts.transport.tier, frozen.config.seed
        with contextlib.ExitStack() as held:
            buf = parts.state.buffers[fl.bucket]
            # a bucket the tier evicted is read back for the trial (gradient included)
            if tier is not None and tier.holds(fl.bucket):
                buf = held.enter_context(tier_access.loaded(tier, fl.bucket, write=False,
                                                                 grad=True))
            # the seeds the real step will use, so stochastic rounding trials the same values
            bad = trial(buf, fl.calls, buf.grad_host, grad_scale=scale, threads=frozen.threads,
                        seeds=[sr_seed(seed, buf.bucket.id, c.step, k)
                               for k, c in enumerate(fl.calls)])
    return _report(it, parts, fl.bucket, bad) if bad else 0


def tail_overflow(it: Iteration, parts: Parts, flights: Sequence[Flight], sum_sq: float,
                  clip: float | None) -> int:
    """The same for the GPU tail buckets, whose statistics come summed (``sum_sq``)."""
    hypers = [c.hyper for fl in flights for c in fl.calls]
    scale = 1.0 / (it.frozen.loss_scale * parts.transport.grad_divisor)
    if not hypers or not may_overflow(sum_sq, scale, hypers) \
            or clipped_safely(sum_sq, scale, hypers, clip):
        return 0
    total = 0
    for fl in flights:
        if not fl.calls:
            continue
        buf = parts.state.buffers[fl.bucket]
        # device_step's calls run with seed 0: the trial uses the same seeds
        bad = trial(buf, fl.calls, parts.transport.tail_grads(fl.bucket), grad_scale=scale,
                    threads=None,
                    seeds=[sr_seed(0, buf.bucket.id, c.step, k) for k, c in enumerate(fl.calls)])
        total += _report(it, parts, fl.bucket, bad) if bad else 0
    return total


def cause(parts: Parts, kind: str, bucket: int) -> skips.Cause:
    """Bucket ``bucket`` stopped the step for ``kind`` (``skips.GRADIENT`` or ``STATE``)."""
    return skips.Cause(kind, bucket, parts.state.names[parts.bucket_params(bucket)[0]])


def _report(it: Iteration, parts: Parts, bucket: int, bad: int) -> int:
    parts.stats.nonfinite_buckets += 1
    it.skip_causes.append(cause(parts, skips.STATE, bucket))
    parts.recorder.note(it.frozen.number, (
        f"bucket {bucket}: the step would make {bad} element(s) of the optimizer state "
        "non-finite (exp_avg_sq = (1-b2) g^2 overflows fp32): counted as a non-finite step, "
        "skipped and rolled back like a non-finite gradient"))
    return bad


def validate_early(it: Iteration, parts: Parts, max_norm: float | None) -> tuple[float, int]:
    """``engine.clip_grad_norm_`` / ``engine.grad_norm``: validate now (every bucket's
    statistics, every rank), keep the result for ``step()``, lower the iteration's threshold
    to ``max_norm`` (None: read only). Returns (total norm of the unscaled gradient,
    non-finite count)."""
    # first: validation must know the step will be clipped (host_overflow's bound)
    if max_norm is not None:
        # clipping twice clips to the smaller norm
        if it.clip_norm is None:
            it.clip_norm = max_norm
        else:
            it.clip_norm = min(it.clip_norm, max_norm)
    if it.validated is None:
        it.validated = validate(it, parts)
    glob, n = it.validated, parts.transport.grad_divisor
    if glob.nonfinite or not math.isfinite(glob.sum_sq):
        # an overflowed sum of finite values still counts one (torch's error must fire)
        return math.inf, max(glob.nonfinite, 1)
    # gradients arrive summed over n ranks: the mean's square norm is sum_sq / n^2
    return math.sqrt(glob.sum_sq / n**2) / it.frozen.loss_scale, 0


def check_clip_args(max_norm: Any, norm_type: Any) -> float | None:
    """``clip_grad_norm_``'s arguments: the global 2-norm, a positive threshold; None for
    ``inf``, which reads the norm and clips nothing, as in torch (Trainer logs its norm so)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}): the engine clips by the "
                         "global 2-norm (the one its speculation validates); use norm_type=2")
    # nan > 0 is False: refused too; a bool is an int to isinstance, and no threshold
    if not (isinstance(max_norm, int | float) and not isinstance(max_norm, bool)
            and max_norm > 0):
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): use a positive number "
                         "(inf reads the norm without clipping; OffloadConfig.max_grad_norm=None "
                         "disables clipping)")
    return None if math.isinf(max_norm) else float(max_norm)


def clip_grad_norm(it: Iteration, parts: Parts, max_norm: float | None,
                   error_if_nonfinite: bool) -> torch.Tensor:
    """``engine.clip_grad_norm_`` once the gradients are final: torch's total norm (a
    tensor), the iteration's threshold lowered to ``max_norm`` (None: unchanged); torch's
    error when asked."""
    norm, nonfinite = validate_early(it, parts, max_norm)
    if error_if_nonfinite and nonfinite:
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return torch.tensor(norm, dtype=torch.float32)


def full_grad(it: Iteration, parts: Parts, index: int) -> torch.Tensor | None:
    """``engine.full_grad`` once the gradients are final: parameter ``index``'s gradient as a
    plain torch loop holds it (unscaled, fp32, a copy); None without one."""
    flight = it.flights.get(parts.state.bucket_of[index])
    if flight is None or index not in flight.present:
        return None
    frozen, transport = it.frozen, parts.transport
    # wait until the move has landed (CUDA: its event too) before reading the host copy
    if flight.stats is not None:
        parts.in_flight.wait(flight.stats, f"gradients of bucket {flight.bucket}",
                             frozen.config.watchdog_s).resolve()
    g = transport.full_grad(index)
    if g is None:
        return None
    # a copy: the caller may edit it without touching the buffer the step reads
    grad = g.detach().to(torch.float32, copy=True)
    return grad.div_(frozen.loss_scale * transport.grad_divisor)


# ---------------------------------------------------------------------------- 2. decide
def clip_threshold(it: Iteration) -> float | None:
    """The iteration's clipping threshold: the configured one and ``clip_grad_norm_``'s, the
    smaller (clipping twice clips to the smaller norm)."""
    # 0 and None both mean "no clipping", as OffloadConfig.max_grad_norm documents
    given = [x for x in (it.frozen.config.max_grad_norm, it.clip_norm) if x]
    return min(given) if given else None


def decide(it: Iteration, parts: Parts, glob: GlobalStats) -> Verdict:
    n = parts.transport.grad_divisor
    # summed over n ranks: divide the squared norm by n^2 (the module docstring)
    return verdict(glob.sum_sq / n**2, glob.nonfinite, loss_scale=it.frozen.loss_scale,
                   max_grad_norm=clip_threshold(it))


# ---------------------------------------------------------------------------- 3. settle
def settle(it: Iteration, v: Verdict, glob: GlobalStats, parts: Parts) -> None:
    """Act on the verdict per bucket (the module docstring, item 3)."""
    st, frozen, transport = parts.state, it.frozen, parts.transport
    # the kernel's factor carries the 1/N of the rank sum along with clip / loss scale
    scale = v.grad_scale / transport.grad_divisor
    collective, tier = transport.ordered_launch, transport.tier
    # forward-need order: the highest bucket ids (first layers) first, tail steps included
    for fl in sorted(flights_of(it), key=lambda f: -f.bucket):
        buf = st.buffers[fl.bucket]
        union = glob.present & frozenset(parts.bucket_params(fl.bucket))
        if fl.on_device:
            # a tail step on the device: torch.optim skips parameters with no gradient anywhere
            if v.action is not Action.SKIP and union:
                calls = make_calls(buf, union, st.group_of, st.steps, frozen.hypers)
                device_step(buf, calls, transport.tail_grads(fl.bucket), grad_scale=scale,
                            threads=None, recorder=parts.recorder, iteration=frozen.number)
            continue
        # a tiered bucket is undone by versions, not by inverse steps (docs/storage.md)
        if tier is not None and tier.holds(fl.bucket):
            tier_steps.settle(tier, fl, commit=v.action is Action.COMMIT and union == fl.present,
                              skip=v.action is Action.SKIP, union=union, glob=glob,
                              frozen=frozen, parts=parts, scale=scale, collective=collective)
            continue
        # another rank's gradient for a parameter this rank lacks: step again with the union,
        # as DDP averages a gradient unused on one rank
        mismatch = union != fl.present
        undone = None
        if fl.spec is not None and (v.action is not Action.COMMIT or mismatch):
            undone = rollback(fl, frozen, parts)
            if v.action is Action.SKIP:
                # the forward must see the restored weights
                parts.publishes.publish(fl.bucket, fl.calls, undone, frozen)
        if v.action is Action.SKIP:
            continue
        if not (fl.spec is None or v.action is Action.CLIP or mismatch):
            if fl.spec is not None and union & glob.partial:
                # a collective publish: this rank joins the ranks that replay this bucket
                parts.publishes.publish(fl.bucket, fl.calls, fl.spec, frozen)
            continue
        calls = fl.calls
        if mismatch:
            calls = make_calls(buf, union, st.group_of, st.steps, frozen.hypers)
        # FSDP2's ordered launch: every rank joins each bucket's collective, with a step or not
        if not calls and not collective:
            continue
        replay = fl.spec is not None
        # the replay runs after its rollback on the same worker (the restored state)
        after: tuple[Future[Any], ...] = ()
        if undone is not None:
            after = (undone,)
        step = parts.submit(step_task(fl.bucket, buf, calls, frozen, parts.recorder, scale=scale,
                                      after=None, speculative=False, replay=replay,
                                      undone=undone),
                            fl.bucket, frozen, after=after)
        # counted only when the speculative step had run and was undone
        if replay:
            step.add_done_callback(parts.stats.counter("replays", when=undone))
        parts.publishes.publish(fl.bucket, calls, step, frozen)


def rollback(fl: Flight, frozen: FrozenIteration, parts: Parts) -> Future[Any]:
    """Undo ``fl``'s speculative step (if it ran) on the worker."""
    assert fl.spec is not None
    fut = parts.submit(rollback_task(fl.bucket, parts.state.buffers[fl.bucket], fl.calls, frozen,
                                     parts.recorder, scale=fl.spec_scale, step_future=fl.spec),
                       fl.bucket, frozen, after=(fl.spec,))
    fut.add_done_callback(parts.stats.counter("rollbacks"))
    return fut


def abort(flights: Sequence[Flight], frozen: FrozenIteration, parts: Parts) -> None:
    """Undo an iteration in progress (an interrupted backward, ``zero_grad()`` before
    ``step()``): every speculative step that ran is rolled back and its restored weights
    published; nothing else of the iteration was applied (the tail steps, the step counts
    and the loss scale change only in ``step()``). Drain the lanes afterwards."""
    tier = parts.transport.tier
    for fl in flights:
        if fl.spec is None:
            continue
        # a tiered bucket: dropping the new version leaves the one in force
        if tier is not None and tier.holds(fl.bucket):
            tier.discard(fl.bucket)
            tier_steps.republish(tier, fl, frozen, parts)
            continue
        parts.publishes.publish(fl.bucket, fl.calls, rollback(fl, frozen, parts), frozen)
    parts.transport.discard([fl.bucket for fl in flights if fl.on_device])


# ---------------------------------------------------------------------------- 4. close
def close_iteration(it: Iteration, v: Verdict, glob: GlobalStats, parts: Parts, *,
                    scaler: LossScaler, adaptive: AdaptiveSTV) -> None:
    """Step counts, loss scaler, counters, adaptive STV, telemetry scalars and notes; every
    rank holds the same verdict, so an overflow skips the step everywhere."""
    rec, stats, frozen = parts.recorder, parts.stats, it.frozen
    # the scale the iteration ran with (the scaler changes it below)
    n, loss_scale = frozen.number, frozen.loss_scale
    skipped = v.action is Action.SKIP
    # every parameter with a gradient somewhere took one step (torch counts per parameter)
    if not skipped:
        steps = parts.state.steps
        for i in sorted(glob.present):
            steps[i] += 1
    # True when fp16's dynamic scale explains the skip (it is still finding its level)
    explained = scaler.update(skipped)
    if skipped:
        stats.skipped_steps += 1
        divisor = parts.transport.grad_divisor
        where = ": step skipped"
        if divisor > 1:
            where = f"on some rank: step skipped on all {divisor} ranks"
        rec.note(n, f"overflow: non-finite gradient{where}; loss scale {loss_scale:g} -> "
                    f"{scaler.loss_scale:g}")
    if v.action is Action.CLIP:
        stats.clipped_steps += 1
    # skips in a row the loss scale does not explain: said once, at SKIP_STREAK (skips.py)
    stats.skip_streak = stats.skip_streak + (not explained) if skipped else 0
    if stats.skip_streak == skips.SKIP_STREAK:
        skips.say(stats.skip_streak, n, it.skip_causes, rec)
    note = adaptive.observe(v.action is Action.CLIP)
    if note:
        rec.note(n, note)
    stats.speculation_enabled = adaptive.enabled
    stats.iterations += 1
    # the only host sync for the loss: after the step, not inside backward
    if it.losses:
        rec.scalar("loss", n, float(sum(float(x) for x in it.losses) / len(it.losses)))
    rec.scalar("grad_norm", n, v.grad_norm)
    rec.scalar("loss_scale", n, loss_scale)
    schedule = parts.state.schedule
    # the effective offload ratio (0 without a schedule)
    rec.scalar("ratio", n, schedule.ratio if schedule is not None else 0.0)
    rec.scalar("speculating", n, 1.0 if frozen.speculate else 0.0)
    # the dashboard marks skipped steps from this scalar
    rec.scalar("skipped", n, 1.0 if skipped else 0.0)
    rec.scalar("skip_streak", n, float(stats.skip_streak))


# ---------------------------------------------------------------------------- adaptive STV
class AdaptiveSTV:
    """Speculate unless clipping fires often (warm-up), then resume when it calms down.

    Over the last ``window`` iterations: speculation switches off when the share of clipped
    iterations exceeds ``threshold`` and back on when it falls to ``threshold / 2`` or below.
    The paper reports clipping in 0.12% of BLOOM-176B's
    steps, mostly early; a replay costs a second CPU step, so a clipping-heavy phase is
    cheaper without speculation.
    """

    def __init__(self, *, mode: str, window: int, threshold: float) -> None:
        self.mode = mode
        self.window = window
        self.threshold = threshold
        self.history: deque[bool] = deque(maxlen=window)
        self.enabled = mode != "off"

    def configure(self, *, mode: str, window: int, threshold: float) -> None:
        self.mode, self.window, self.threshold = mode, window, threshold
        self.history = deque(self.history, maxlen=window)
        if mode == "on":
            self.enabled = True
        elif mode == "off":
            self.enabled = False

    @property
    def clip_rate(self) -> float:
        return sum(self.history) / len(self.history) if self.history else 0.0

    def observe(self, clipped: bool) -> str | None:
        """Record one iteration's outcome; return a note when speculation switches."""
        self.history.append(bool(clipped))
        if self.mode != "adaptive":
            return None
        rate, n = self.clip_rate, len(self.history)
        clipped_count = sum(self.history)
        if self.enabled and rate > self.threshold:
            self.enabled = False
            return (f"adaptive STV: speculation off, clipping fired in {clipped_count} of the "
                    f"last {n} iterations (> {self.threshold:.0%})")
        # hysteresis: back on only at half the threshold, so it does not flap at the edge
        if not self.enabled and rate <= self.threshold / 2:
            self.enabled = True
            return (f"adaptive STV: speculation back on, clipping fired in {clipped_count} of "
                    f"the last {n} iterations")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "history": [bool(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a fixed mode wins over the saved switch; "adaptive" resumes where it was
        if self.mode == "adaptive":
            self.enabled = bool(state["enabled"])
        else:
            self.enabled = self.mode == "on"
        self.history = deque((bool(h) for h in state["history"]), maxlen=self.window)
