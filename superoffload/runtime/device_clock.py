"""CUDA events as the device clock of the telemetry (what the GPU did, not when the host
enqueued it).

A mark is a ``torch.cuda.Event(enable_timing=True)`` recorded on a stream, plus the reference
it is measured from: ``calibrate()`` records a reference event, waits for it and reads the
recorder's host clock at that instant, so a mark's time is ``t_ref + ref.elapsed_time(mark)``
(CUDA's event timer, milliseconds; PyTorch docs, ``torch.cuda.Event.elapsed_time``). The two
clocks drift apart by parts per million; the engine recalibrates at every ``synchronize()``,
and each mark keeps the reference it was taken against. ``seconds(mark)`` is None until the
device has reached the mark (``Event.query()``), never blocking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CudaClock:
    """Device marks on CUDA streams, read on a recorder's clock (see the module docstring)."""

    def __init__(self, device: torch.device, now: Callable[[], float]) -> None:
        self.device, self.now = device, now
        self.calibrate()

    def calibrate(self) -> None:
        """Take a new reference: one event, waited for, and the host time it completed at."""
        ref = torch.cuda.Event(enable_timing=True, blocking=True)
        ref.record(torch.cuda.current_stream(self.device))
        ref.synchronize()
        self._ref: tuple[Any, float] = (ref, self.now())

    def mark(self, stream: Any = None) -> tuple[Any, Any, float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        ref, t_ref = self._ref
        return event, ref, t_ref

    def seconds(self, mark: Any) -> float | None:
        event, ref, t_ref = mark
        if not event.query():
            return None
        return t_ref + ref.elapsed_time(event) / 1e3
