"""The timeline event format shared by the engine's recorder, the simulator and the widgets.

One `Span` is one piece of work on one lane. The engine records real spans; the planner's
simulator emits the same type, so one widget draws both (DESIGN.md §2, §5).
Times are seconds relative to the recorder's (or simulation's) origin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Lanes, in display order (paper Fig. 5 style): device compute, the two link directions,
# the CPU optimizer and the device optimizer.
LANE_COMPUTE = "device_compute"
LANE_D2H = "d2h"
LANE_H2D = "h2d"
LANE_CPU = "cpu_optimizer"
LANE_DEVICE_OPT = "device_optimizer"
# The storage tier (docs/storage.md): reads and write-backs of optimizer state and weights kept
# in files, a lane of its own because the disk is a resource the step can wait on.
LANE_STORAGE = "storage"
LANES: tuple[str, ...] = (LANE_COMPUTE, LANE_D2H, LANE_CPU, LANE_H2D, LANE_DEVICE_OPT,
                          LANE_STORAGE)
LANE_LABELS: dict[str, str] = {
    LANE_COMPUTE: "device compute",
    LANE_D2H: "D2H (grads out)",
    LANE_CPU: "CPU optimizer",
    LANE_H2D: "H2D (weights in)",
    LANE_DEVICE_OPT: "device optimizer",
    LANE_STORAGE: "storage I/O",
}
"""Display names of the lanes (the timeline's rows, the trace's tracks, the report)."""

# Kinds of span. A kind belongs to one lane, except "wait" (a lane blocked on another).
KIND_FORWARD = "forward"
KIND_BACKWARD = "backward"
KIND_D2H = "d2h"
KIND_H2D = "h2d"
KIND_CPU_STEP = "cpu_step"
KIND_DEVICE_STEP = "device_step"
KIND_VALIDATE = "validate"
KIND_ROLLBACK = "rollback"
KIND_REPLAY = "replay"
KIND_WAIT = "wait"
KIND_WEIGHT_FETCH = "weight_fetch"
KIND_TIER_READ = "tier_read"
KIND_TIER_WRITE = "tier_write"
SPAN_KINDS: tuple[str, ...] = (
    KIND_FORWARD,
    KIND_BACKWARD,
    KIND_D2H,
    KIND_H2D,
    KIND_CPU_STEP,
    KIND_DEVICE_STEP,
    KIND_VALIDATE,
    KIND_ROLLBACK,
    KIND_REPLAY,
    KIND_WAIT,
    KIND_WEIGHT_FETCH,
    KIND_TIER_READ,
    KIND_TIER_WRITE,
)


def lanes_in(spans: Iterable[Span]) -> tuple[str, ...]:
    """The lanes that hold at least one of `spans`, in `LANES` order: what a view draws
    (a run without storage spans gets no storage row; docs/jupyter.md, "The timeline")."""
    present = {s.lane for s in spans}
    return tuple(lane for lane in LANES if lane in present)


@dataclass(frozen=True, slots=True)
class Span:
    """One interval of work on one lane."""

    lane: str
    """One of LANES."""
    kind: str
    """One of SPAN_KINDS."""
    start_s: float
    """Start, seconds since the timeline's origin."""
    end_s: float
    """End, seconds since the timeline's origin (>= start_s)."""
    iteration: int
    """Optimizer iteration the work belongs to."""
    bucket: int = -1
    """Bucket id, or -1 for work not tied to a bucket (forward, backward, validation)."""
    nbytes: int = 0
    """Bytes moved (transfers) or touched (optimizer), 0 when not meaningful."""
    rank: int = 0
    """Data-parallel rank that recorded the span."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "lane": self.lane,
            "kind": self.kind,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "iteration": self.iteration,
            "bucket": self.bucket,
            "nbytes": self.nbytes,
            "rank": self.rank,
        }
