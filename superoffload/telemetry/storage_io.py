"""What the storage tier did, from the timeline's storage spans (docs/storage.md, "Seen and
measured"): the rates its reads and writes ran at, the bytes one iteration moves, and the
time nothing else ran while it did -- the disk exposed on the iteration's critical path.

Pure over ``Span``s (engine-recorded or simulated alike, telemetry/events.py):

* ``read_gbps`` / ``write_gbps``: bytes over the time spans of that kind were in flight
  (their union: overlapping requests count once), 1 GB = 1e9 B;
* ``read_bytes_per_iteration`` / ``write_bytes_per_iteration``: over the iterations seen;
* ``exposed_s_per_iteration``: storage time during which neither the device computed nor
  the CPU optimizer stepped -- the iteration waited on the disk alone (0 when the I/O hid).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from superoffload.telemetry.events import (
    KIND_TIER_READ,
    KIND_TIER_WRITE,
    KIND_WAIT,
    LANE_COMPUTE,
    LANE_CPU,
    LANE_STORAGE,
    Span,
)
from superoffload.telemetry.intervals import length, subtract, union


@dataclass(frozen=True, slots=True)
class StorageIO:
    """The storage tier over a run (module docstring for each figure)."""

    iterations: int
    read_gbps: float
    write_gbps: float
    read_bytes_per_iteration: float
    write_bytes_per_iteration: float
    exposed_s_per_iteration: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line for the CLI summary."""
        return (f"storage tier: read {self.read_gbps:.3g} GB/s, write {self.write_gbps:.3g} "
                f"GB/s while moving; {self.read_bytes_per_iteration / 1e9:.3g} GB read + "
                f"{self.write_bytes_per_iteration / 1e9:.3g} GB written per iteration; "
                f"exposed {1e3 * self.exposed_s_per_iteration:.3g} ms per iteration (the "
                "step waiting on the disk alone)")


def storage_io(spans: Iterable[Span]) -> StorageIO | None:
    """The figures over ``spans``; None when the run had no storage tier."""
    spans = list(spans)
    io = [s for s in spans if s.lane == LANE_STORAGE]
    if not io:
        return None
    iterations = len({s.iteration for s in spans}) or 1

    def rate(kind: str) -> tuple[float, float]:
        chosen = [s for s in io if s.kind == kind]
        busy = length((s.start_s, s.end_s) for s in chosen)
        moved = float(sum(s.nbytes for s in chosen))
        return (moved / busy / 1e9 if busy > 0 else 0.0), moved

    read_gbps, read_bytes = rate(KIND_TIER_READ)
    write_gbps, write_bytes = rate(KIND_TIER_WRITE)
    working = [(s.start_s, s.end_s) for s in spans
               if (s.lane == LANE_COMPUTE and s.kind != KIND_WAIT) or s.lane == LANE_CPU]
    exposed = length(subtract(union((s.start_s, s.end_s) for s in io), working))
    return StorageIO(iterations, read_gbps, write_gbps, read_bytes / iterations,
                     write_bytes / iterations, exposed / iterations)
