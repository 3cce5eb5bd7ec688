"""Micro-steps of gradient accumulation, counted the same way for both backward paths.

``OffloadConfig.grad_accum_steps`` = K: the engine steps once per K backward passes, whether
they are ``engine.backward(loss)`` calls (which offload buckets as gradients become final)
or the user's own ``loss.backward()`` (gradients sum in ``.grad``; ``step()`` then moves
every bucket at once, without overlap or speculation). The gradient hooks count the user's
passes (``IterationScheduler.plain_passes``), so a loop that calls ``step()`` on every
micro-batch -- DeepSpeed's and Accelerate's habit -- and one that calls it once per K
backward passes -- torch's -- both step once per K micro-batches. The two kinds never mix
in one accumulation window, and more than K passes before ``step()`` are refused: never a
step over a silently different batch.
"""

from __future__ import annotations

from superoffload.config import OffloadConfig
from superoffload.runtime.errors import EngineError
from superoffload.runtime.guard import ContractError
from superoffload.runtime.scheduler import IterationScheduler


def done(sched: IterationScheduler) -> int:
    """Backward passes since the last step, of either kind."""
    return sched.current.micro_step or sched.plain_passes()


def check_backward(sched: IterationScheduler, config: OffloadConfig) -> None:
    """Before ``engine.backward``: refuse what cannot join this accumulation window."""
    passes, it = sched.plain_passes(), sched.current
    if passes:
        raise ContractError(
            f"engine.backward() after {passes} plain loss.backward() call(s) since the last "
            "step(): one accumulation window takes one kind of backward (engine.backward "
            "overlaps the offload; loss.backward() sums in .grad until step()). Finish the "
            "window with loss.backward() and step(), then use engine.backward from the next "
            "one; nothing was changed")
    if sched.sum_on_host and sched.transforms:
        raise ContractError(
            "engine.register_grad_transform with OffloadConfig.grad_accum_on='host': the "
            "gradients leave every micro-step and are summed on the host, so no device "
            "gradient holds the sum a transform should see. Use grad_accum_on='device', or "
            "remove the transform; nothing was changed")
    if it.micro_step >= config.grad_accum_steps:
        raise EngineError(
            f"backward() was called {it.micro_step + 1} times since the last step() with "
            f"OffloadConfig.grad_accum_steps={config.grad_accum_steps}: the last micro-step's "
            "buckets are already offloaded and stepped, so another gradient cannot join them. "
            "Call step() after every grad_accum_steps backward() calls (raise "
            "grad_accum_steps to accumulate more); nothing was changed")


def check_plain_passes(sched: IterationScheduler, config: OffloadConfig, where: str) -> None:
    """At the step boundary of the user's own backward passes: exactly K of them."""
    passes, gas = sched.plain_passes(), config.grad_accum_steps
    if passes > gas:
        raise ContractError(
            f"{where} after {passes} loss.backward() passes with OffloadConfig."
            f"grad_accum_steps={gas}: the engine steps once per {gas} backward pass(es), so "
            f"the gradients summed in .grad hold {passes} micro-batches. Call step() after "
            f"every {gas} backward pass(es) (or set grad_accum_steps={passes}); zero_grad() "
            "discards them; nothing was changed")
