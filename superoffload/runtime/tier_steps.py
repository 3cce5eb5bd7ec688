"""The step's phases for a bucket whose state lives on the storage tier (runtime/tier.py):
what ``launch`` and ``settle`` do differently (paper §4.3 on the tier; docs/storage.md).

The schedule is the in-memory one; only undoing differs. A speculative step writes the
version of the state not in force, so a rollback is the version switch not made: bit-exact
whatever ``OffloadConfig.rollback`` says, no inverse, no snapshot. The gradient always goes to
the file with the state (a replay after clipping, a step after the verdict and
``engine.full_grad`` read it back: the slot is long gone by then).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.iteration import Flight, Parts
from superoffload.runtime.steps import make_calls, step_task
from superoffload.runtime.tier import StateTier
from superoffload.runtime.transport import GlobalStats


def after_launch(tier: StateTier, fl: Flight, published: Future[Any] | None) -> None:
    """The launch submitted bucket ``fl``'s work: write it back and free its slot. A bucket
    not speculated keeps only its gradient (the verdict's step reads it back); a speculated
    one writes its new state to the version validation decides on."""
    if fl.spec is None:
        tier.finish(fl.bucket, after=(), step=None, state=False, grad=True, published=None,
                    speculative=False, d2h=fl.stats)
        return
    tier.finish(fl.bucket, after=(fl.spec,), step=fl.spec, state=True, grad=True,
                published=published, speculative=True)


def settle(tier: StateTier, fl: Flight, *, commit: bool, skip: bool, union: frozenset[int],
           glob: GlobalStats, frozen: FrozenIteration, parts: Parts, scale: float,
           collective: bool) -> None:
    """Act on the verdict for tier bucket ``fl`` (runtime/stv.py ``settle``, item 3):
    ``commit`` keeps a speculative step that covered ``union`` (its version comes into force);
    else the version in force stays and, unless ``skip``, the bucket is stepped now from the
    state in force and the gradient read back (a replay when it had speculated)."""
    b, st = fl.bucket, parts.state
    if fl.spec is not None and commit:
        tier.commit(b)
        # ranks that replay publish again: so do these
        if union & glob.partial:
            republish(tier, fl, frozen, parts)
        return
    # the rollback: the speculative version is never read
    if fl.spec is not None:
        tier.discard(b)
        fl.spec.add_done_callback(parts.stats.counter("rollbacks"))
        if skip:
            # the device holds the speculative weights
            republish(tier, fl, frozen, parts)
    if skip:
        return
    calls = fl.calls
    # another rank's gradient for a parameter this rank lacks: step with the union
    if union != fl.present:
        calls = make_calls(st.buffers[b], union, st.group_of, st.steps, frozen.hypers)
    if not calls and not collective:
        return
    loaded = tier.bind(b, grad=True)
    assert loaded is not None
    step = parts.submit(step_task(b, st.buffers[b], calls, frozen, parts.recorder, scale=scale,
                                  after=None, speculative=False, replay=fl.spec is not None,
                                  undone=fl.spec, versioned=True),
                        b, frozen, after=(loaded,))
    # counted only when the speculative step had run
    if fl.spec is not None:
        step.add_done_callback(parts.stats.counter("replays", when=fl.spec))
    pub = parts.publishes.publish(b, calls, step, frozen)
    tier.finish(b, after=(step,), step=step, state=True, grad=False, published=pub.device,
                speculative=False)


def republish(tier: StateTier, fl: Flight, frozen: FrozenIteration, parts: Parts) -> None:
    """Publish the weights of the version in force again (after a rollback the device holds
    the speculative ones): read, the low-precision copy made from the master, copied over."""
    loaded = tier.bind(fl.bucket, cast_lp=True)
    assert loaded is not None
    pub = parts.publishes.publish(fl.bucket, fl.calls, loaded, frozen)
    tier.finish(fl.bucket, after=(loaded,), step=None, state=False, grad=False,
                published=pub.device, speculative=False)
