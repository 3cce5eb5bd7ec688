"""Which gradients the device holds, and for how long: the engine's rule, declared once.

The engine (runtime/) frees what it has copied out, the planner charges what is left; both
read this module, so "fits" and "runs" agree. During one optimizer step:

* GPU tail buckets (paper §4.2: stepped on the device): every tail parameter's gradient, in
  the model's dtype, from its first accumulation until ``zero_grad()``;
* offloaded (host) buckets: a bucket's gradients leave with its D2H copy and are freed once it
  has landed. At most ``grad_buckets_in_flight`` complete buckets wait for their copy (backward
  waits for the oldest beyond that), plus the one backward is filling: at most
  ``(grad_buckets_in_flight + 1) x`` the largest host bucket's elements, never more than all
  offloaded elements (DeepSpeed ZeRO-2 frees them the same way, per reduce bucket);
* all offloaded gradients instead stay resident when the user keeps them
  (``OffloadConfig.keep_device_grads``: ``p.grad`` as in a plain torch loop) or when
  ``grad_accum_steps`` > 1 accumulates them on the device (``grad_accum_on="device"``: they
  leave on the last micro-step only);
* accumulating on the host (``grad_accum_on="host"``, ZeRO-Offload's way) keeps the in-flight
  bound on every micro-step; the tail still accumulates on the device.

Between micro-steps of one optimizer step (``grad_accum_steps`` > 1) the gradients that
accumulate on the device are resident while the next forward runs: ``carried_numel``.

Element bytes: the model's dtype (bf16/fp16 2 B, fp32 4 B). An fp32 copy made on the device
for device-side casting is staging (plan/memory.py), not a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

AccumPlace = Literal["device", "host"]
PLACES: tuple[AccumPlace, ...] = get_args(AccumPlace)
"""Where gradients of offloaded buckets accumulate over micro-steps: ``grad_accum_on`` decided
(the config's members without "auto"; tests/test_plan_schedule.py checks they agree)."""


@dataclass(frozen=True, slots=True)
class DeviceGrads:
    """The device gradients of one schedule, as element counts (``device_grads`` builds it)."""

    tail_numel: int
    """Elements of the GPU tail buckets: resident from their first gradient to zero_grad()."""
    offloaded_numel: int
    """Elements of the offloaded (host) buckets."""
    in_flight_numel: int
    """The most offloaded elements whose gradients may be resident at once while their buckets
    leave: (grad_buckets_in_flight + 1) x the largest host bucket, at most offloaded_numel."""
    kept_numel: int
    """Offloaded elements whose gradients stay on the device until zero_grad() (kept, or
    accumulating there): all of them, none, or all but weight-flow's streamed blocks'."""
    accumulating: bool
    """grad_accum_steps > 1: earlier micro-steps' gradients are resident during a forward."""
    rule: str
    """The rule that applies, in words (for reports)."""

    @property
    def offloaded_peak_numel(self) -> int:
        """Offloaded elements resident at the worst moment of backward."""
        return min(self.offloaded_numel, self.kept_numel + self.in_flight_numel)

    @property
    def peak_numel(self) -> int:
        """Gradient elements on the device at the worst moment (tail + offloaded bound)."""
        return self.tail_numel + self.offloaded_peak_numel

    @property
    def carried_numel(self) -> int:
        """Elements resident from earlier micro-steps while a later one's forward runs: the
        tail's and the kept ones (0 without accumulation: ``zero_grad()`` ran before)."""
        if not self.accumulating:
            return 0
        return self.tail_numel + self.kept_numel

    def offloaded_resident_numel(self, arrived: float) -> float:
        """Offloaded elements resident once ``arrived`` of them have been produced in this
        backward (with accumulation the kept ones are there from the start)."""
        if self.accumulating:
            return min(float(self.offloaded_numel),
                       self.kept_numel + min(arrived, float(self.in_flight_numel)))
        return min(arrived, float(self.kept_numel + self.in_flight_numel))


def device_grads(host_bucket_numels: Sequence[int], tail_numel: int, *,
                 grad_buckets_in_flight: int = 2, keep_device_grads: bool = False,
                 grad_accum_steps: int = 1, grad_accum_on: str = "device",
                 streamed_numel: int = 0) -> DeviceGrads:
    """The rule (module docstring) for a bucket table: ``host_bucket_numels`` the elements of
    each offloaded bucket, ``tail_numel`` those stepped on the device; the other arguments are
    the OffloadConfig fields of the same names, ``grad_accum_on`` already resolved ("device"
    or "host": ``plan.grad_accum.choose_grad_accum`` decides "auto"). ``streamed_numel``:
    offloaded elements of weight-flow's streamed blocks, whose gradients leave whatever the
    settings (their weights are not resident; runtime/departures.py)."""
    if grad_accum_on not in PLACES:
        raise ValueError(f"device_grads: grad_accum_on={grad_accum_on!r}; resolve 'auto' first "
                         "(plan.grad_accum.choose_grad_accum) and pass one of "
                         f"{', '.join(PLACES)}")
    if grad_buckets_in_flight < 1 or grad_accum_steps < 1:
        raise ValueError(f"device_grads: grad_buckets_in_flight={grad_buckets_in_flight} and "
                         f"grad_accum_steps={grad_accum_steps} must be >= 1")
    offloaded = int(sum(host_bucket_numels))
    largest = int(max(host_bucket_numels, default=0))
    in_flight = min(offloaded, (grad_buckets_in_flight + 1) * largest)
    accumulating = grad_accum_steps > 1
    on_device = accumulating and grad_accum_on == "device"
    kept = 0
    if keep_device_grads or on_device:
        # weight-flow's streamed blocks leave whatever the settings: their weights are not
        # resident, so neither are their gradients (runtime/departures.py)
        kept = max(0, offloaded - int(streamed_numel))
    streamed = " (weight-flow's streamed blocks leave regardless)" if streamed_numel else ""
    if keep_device_grads:
        rule = "keep_device_grads: offloaded gradients stay until zero_grad()" + streamed
    elif on_device:
        rule = (f"grad_accum_steps={grad_accum_steps} accumulating on the device: offloaded "
                "gradients stay until the last micro-step" + streamed)
    else:
        rule = (f"offloaded gradients leave with their bucket: at most "
                f"{grad_buckets_in_flight} + 1 buckets of {largest:,} elements in flight")
    return DeviceGrads(tail_numel=int(tail_numel), offloaded_numel=offloaded,
                       in_flight_numel=in_flight, kept_numel=kept, accumulating=accumulating,
                       rule=rule)
