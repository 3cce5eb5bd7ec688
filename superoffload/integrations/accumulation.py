"""The accumulation window of an Accelerate loop, as the engine must see it
(integrations/accelerate.py; docs/integrations.md, "Hugging Face Accelerate").

Accelerate's `accumulate()` ends a window at every `gradient_accumulation_steps`-th backward
pass and, by default, also at the data loader's last batch, whatever its length: a loader of
21 batches with accumulation 2 steps ten times on two micro-batches and once on the last one,
whose gradient is that one loss divided by 2 (accelerate always divides by the accumulation
steps). The engine steps after exactly `grad_accum_steps` backward passes, so the short
window is completed with zero passes (`pad_window`): each reaches no parameter, so every
gradient sum stays what the real passes made it, the engine's last pass launches the buckets,
and the step is the one plain Accelerate takes (tests/test_accelerate_window.py compares the
weights). The engine's logged loss of that step averages its zeros in too.

A window closed early for any other reason is a loop that does not drive accumulation
through `accumulate()` (whose `sync_gradients` then stays True): `early_step_error` names
that, not the data loader. A manual loop that steps at the loader's end itself is completed
the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from superoffload.config import ConfigError


def complete_window(engine: Any, passes: int, accelerator: Any, where: str) -> None:
    """`where` reads the gradients of a window of `passes` backward passes, with
    `accelerator.sync_gradients` True: a window accelerate ended at the data loader's last
    batch is completed with zero passes; any other early end is refused."""
    steps, state = accelerator.gradient_accumulation_steps, accelerator.gradient_state
    # accelerate's own rule for ending a window at the loader's end (`Accelerator.accumulate`)
    if 0 < passes < steps and state.sync_with_dataloader and state.end_of_dataloader:
        pad_window(engine, steps - passes, accelerator.device)
    elif passes != steps:
        raise early_step_error(where, passes, steps)


def pad_window(engine: Any, passes: int, device: torch.device) -> None:
    """`passes` more `engine.backward` calls of a zero loss that reaches no parameter: the
    gradient sums stay what they are (no parameter's hook fires) and the last one arms the
    step, launching every bucket with the sums of the real passes."""
    for _ in range(passes):
        zero = torch.zeros((), device=device, requires_grad=True)
        engine.backward(zero, scale_wrt_gas=False)


def early_step_error(where: str, done: int, steps: int) -> ConfigError:
    """`where` (optimizer.step(), clip_grad_norm_) with `accelerator.sync_gradients` True
    after `done` of `steps` backward passes, not at the end of a data loader."""
    if done == 0:
        return ConfigError(
            f"{where} before any accelerator.backward() since the last optimizer step: there "
            "is no gradient to step with; call accelerator.backward(loss) first")
    return ConfigError(
        f"{where} with accelerator.sync_gradients=True after {done} of {steps} backward "
        f"passes (Accelerator(gradient_accumulation_steps={steps})): this loop does not "
        "accumulate through accelerator.accumulate(model), so Accelerate asks for a step "
        "after every backward. Put each micro-step under `with accelerator.accumulate(model):` "
        f"(it steps after every {steps}th backward and at the end of the data loader), or "
        f"call it only after every {steps}th backward, or use gradient_accumulation_steps=1; "
        "nothing was changed")
