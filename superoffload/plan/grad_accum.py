"""Where gradients of offloaded buckets accumulate over micro-steps: on the device or the host.

With ``grad_accum_steps`` > 1 an optimizer step runs several forward/backward passes before
the buckets are stepped. Two ways to add up the offloaded buckets' gradients:

* "device": they stay on the device, where backward accumulates into ``p.grad``, and leave
  once, on the last micro-step. No copies on the other micro-steps, but every offloaded
  gradient is resident for the whole optimizer step (plan/device_grads.py);
* "host" (ZeRO-Offload's way, Ren et al. 2021 §4): every micro-step's gradients leave with
  their bucket and the host adds them into its fp32 gradient buffer (already there for the
  step). The device holds only the buckets in flight; each micro-step pays a D2H of the
  offloaded gradients and a pass over the host's buffer (plan/sim_core.py,
  ``accumulation_micro_step_s``).

``choose_grad_accum`` decides "auto" (OffloadConfig.grad_accum_on) from the planner's own
figures, the ``plan.memory`` and ``plan.sim_core`` every prediction uses:

1. one micro-step per optimizer step: nothing accumulates, the place does not matter:
   "device";
2. one memory pool (an APU, or the CPU backend where the "device" is the CPU): the host
   saves no memory and its copies cost time: "device";
3. otherwise the faster of the two that fit device memory. The micro-step that steps is the
   same for both, so the time compared is that of the grad_accum_steps - 1 micro-steps that
   only accumulate; "host" when accumulating on the device does not fit (or neither does:
   the host needs less).

``resolve_decided`` is ``techniques.resolve`` with that decision made first: every planner entry
point (simulate, the memory search, capacity) resolves through it, so a prediction describes the
place the engine uses. Pure: no torch, no threads (docs/conventions.md, "Pure planning core").
The engine calls ``choose_grad_accum`` for "auto" with its own facts (``ModelShape.from_module``
of the model, the resolved profile: the rank's share of the host when ranks share one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superoffload.config import OffloadConfig
from superoffload.plan.device_grads import PLACES, AccumPlace
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory import check_fits, memory
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.sim_core import accumulation_micro_step_s
from superoffload.plan.techniques import Techniques, resolve
from superoffload.plan.weights import fmt_gb


@dataclass(frozen=True, slots=True)
class GradAccumChoice:
    """The decision and the figures it compared (None where nothing was compared)."""

    place: AccumPlace
    """"device" or "host"."""
    reason: str
    """Why, in plain words with the numbers."""
    device_accumulation_s: float | None = None
    """Predicted seconds of the grad_accum_steps - 1 accumulating micro-steps on the device."""
    host_accumulation_s: float | None = None
    """The same, accumulating on the host (their D2H copies and host adds included)."""
    device_accum_device_bytes: float | None = None
    """Peak device bytes accumulating on the device (every offloaded gradient resident)."""
    host_accum_device_bytes: float | None = None
    """Peak device bytes accumulating on the host (only the buckets in flight)."""
    device_memory_bytes: float | None = None
    """The profile's device memory (the check keeps plan.memory's headroom free)."""


def choose_grad_accum(shape: ModelShape, profile: HardwareProfile, config: OffloadConfig, *,
                      techniques: Techniques | None = None, auto: Any = None
                      ) -> GradAccumChoice:
    """Decide where offloaded gradients accumulate for ``config`` (module docstring), whatever
    ``config.grad_accum_on`` says (the rule book honours an explicit one). ``techniques``: the
    ablation switches; ``auto``: the WeightChoice when ``config.weights`` is "auto" (or pass
    the decided policy in ``config.weights``)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"choose_grad_accum: shape must be a ModelShape, got "
                        f"{type(shape).__name__}")
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"choose_grad_accum: profile must be a HardwareProfile, got "
                        f"{type(profile).__name__}")
    steps = config.grad_accum_steps
    if steps == 1:
        return GradAccumChoice("device", "grad_accum_on=device: grad_accum_steps=1, nothing "
                               "accumulates (every micro-step is an optimizer step), so the "
                               "place does not matter")
    if profile.shared_memory or profile.device_type == "cpu":
        if profile.device_type == "cpu":
            pool = "the device is the CPU"
        else:
            pool = "device and host share one memory pool"
        return GradAccumChoice("device", f"grad_accum_on=device: on {profile.name} {pool}: "
                               "accumulating on the host saves no memory and its copies cost "
                               "time")
    seconds: dict[str, float] = {}
    device_bytes: dict[str, float] = {}
    problems: dict[str, list[str]] = {}
    for where in PLACES:
        plan = resolve(shape, profile, "superoffload", config.replace(grad_accum_on=where),
                       techniques, auto=auto)
        mem = memory(shape, profile, plan)
        seconds[where] = (steps - 1) * accumulation_micro_step_s(shape, profile, plan)
        device_bytes[where] = mem.device
        problems[where] = check_fits(mem, profile)
    dev_fits, host_fits = not problems["device"], not problems["host"]
    numbers = (f"the {steps - 1} micro-steps that only accumulate take "
               f"{seconds['device'] * 1e3:.4g} ms on the device vs {seconds['host'] * 1e3:.4g} "
               f"ms on the host (D2H + host add each); device memory "
               f"{fmt_gb(device_bytes['device'])} vs {fmt_gb(device_bytes['host'])} of "
               f"{fmt_gb(profile.device_memory_bytes)}")
    place: AccumPlace
    if dev_fits and host_fits:
        # a tie goes to the device: it makes no copies and runs no host add
        place = "host" if seconds["host"] < seconds["device"] else "device"
        if seconds["host"] != seconds["device"]:
            why = f"both fit; the {place} is faster"
        else:
            why = "both fit and take as long: the device (no copies)"
    elif dev_fits:
        place, why = "device", "only accumulating on the device fits: " + "; ".join(
            problems["host"])
    elif host_fits:
        place, why = "host", ("accumulating on the device does not fit (every offloaded "
                              "gradient stays resident): " + "; ".join(problems["device"]))
    else:
        place, why = "host", ("neither fits; the host needs the least device memory: "
                              + "; ".join(problems["host"]))
    return GradAccumChoice(
        place, f"grad_accum_on={place}: {why}; {numbers}",
        device_accumulation_s=seconds["device"], host_accumulation_s=seconds["host"],
        device_accum_device_bytes=device_bytes["device"],
        host_accum_device_bytes=device_bytes["host"],
        device_memory_bytes=profile.device_memory_bytes)


def resolve_decided(shape: ModelShape, prof: HardwareProfile, system: str,
                    config: OffloadConfig | None, techniques: Techniques | None, *,
                    auto: Any = None) -> Resolved:
    """``techniques.resolve`` with grad_accum_on="auto" decided first (``choose_grad_accum``)
    when it matters: the SuperOffload schedule accumulating over several micro-steps."""
    accum = None
    if (system == "superoffload" and config is not None and config.grad_accum_on == "auto"
            and config.grad_accum_steps > 1):
        accum = choose_grad_accum(shape, prof, config, techniques=techniques, auto=auto)
    return resolve(shape, prof, system, config, techniques, auto=auto, accum=accum)
