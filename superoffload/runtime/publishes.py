"""Publishes in flight: the next forward waits per bucket, a racing write is refused (§4.2).

After a bucket's CPU step its new weights are published (H2D, or an all-gather); a module's
forward pre-hook waits only for its own buckets' last publish, so the first layers (GPU tail
buckets) start at once. A parameter written while its publish is still in flight raced the
copy lane: every write since ``step()`` is discarded and ``WeightsWrittenInFlight`` raised
(runtime/guard.py, runtime/weight_writes.py). Owned by the iteration scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from superoffload.runtime.backend import Backend
from superoffload.runtime.guard import Contract
from superoffload.runtime.state import EngineState
from superoffload.runtime.transport import Transport
from superoffload.telemetry.events import KIND_WAIT, LANE_COMPUTE
from superoffload.telemetry.recorder import Recorder


class Publishes:
    """Per bucket, the last publish a module must wait for before it runs."""

    def __init__(self, *, state: EngineState, contract: Contract, backend: Backend,
                 recorder: Recorder, transport: Transport,
                 wait: Callable[[Future[Any], str], Any],
                 streamed: Callable[[], frozenset[int]], iteration: Callable[[], int]) -> None:
        self.state, self.contract, self.backend = state, contract, backend
        self.recorder, self.transport = recorder, transport
        self.wait, self.streamed, self.iteration = wait, streamed, iteration
        self.pending: dict[int, Future[Any]] = {}

    def wait_for_weights(self, indices: Iterable[int]) -> None:
        """Forward pre-hook of a module: its own buckets' last publish, nothing else (§4.2).
        A parameter written while that publish was in flight raced the copy lane: the write is
        discarded (the published weights restored) and ``WeightsWrittenInFlight`` raised."""
        bucket_of = self.state.bucket_of
        buckets = {bucket_of[i] for i in indices if i in bucket_of}
        for b in sorted(buckets):
            fut = self.pending.pop(b, None)
            if fut is None:
                continue
            if self.contract.written([i for i in indices if bucket_of.get(i) == b],
                                     self.streamed()):  # a write inside the forward itself
                self.pending[b] = fut
                self.discard_racing_writes()  # every bucket still in flight, then raise
            t0 = self.recorder.now()
            self.backend.wait(self.wait(fut, f"{self.transport.name} publish of bucket {b}"))
            self.recorder.add(LANE_COMPUTE, KIND_WAIT, t0, self.recorder.now(),
                              iteration=self.iteration(), bucket=b)

    def discard_racing_writes(self) -> None:
        """Wait for every publish still in flight (from the training thread's view: not yet
        waited for by a forward or a synchronize). If a parameter of those buckets was written
        meanwhile, the write raced the copy lane, whatever the timing: every write since
        ``step()`` is discarded (the published weights restored, so no mix of written and
        published buckets) and ``WeightsWrittenInFlight`` raised (runtime/weight_writes.py)."""
        bucket_of, pending = self.state.bucket_of, dict(self.pending)
        written = self.contract.written(self.state.trainable, self.streamed()) if pending else []
        racing = [i for i in written if bucket_of.get(i) in pending]
        for b, fut in pending.items():
            self.backend.wait(self.wait(fut, f"{self.transport.name} publish of bucket {b}"))
            self.pending.pop(b, None)
        self.backend.synchronize()
        if racing:
            lost = self.transport.restore(written) or []
            self.contract.rebase(written)
            raise self.contract.in_flight_error(racing, lost)

    def check_writes_before_forward(self) -> None:
        """Root forward pre-hook: a write racing an in-flight publish is refused before any
        module runs (``discard_racing_writes``); other writes wait for the next iteration's
        adoption."""
        if not self.pending:
            return
        bucket_of = self.state.bucket_of
        if any(bucket_of.get(i) in self.pending
               for i in self.contract.written(self.state.trainable, self.streamed())):
            self.discard_racing_writes()
