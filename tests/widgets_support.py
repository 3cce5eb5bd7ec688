"""Fakes for the widget tests: a recorder filled with a plausible SuperOffload schedule, a
fake engine that records `reconfigure` calls, a fake IPython kernel shell."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from superoffload.config import RECONFIGURABLE, OffloadConfig
from superoffload.telemetry.recorder import Recorder

MB = 1_000_000


def record_iteration(
    rec: Recorder, it: int, t0: float, *, buckets: int = 3, rollback: bool = False,
    loss: float | None = None, ratio: float | None = None,
) -> float:
    """Record one iteration starting at t0 (seconds): forward, backward with per-bucket
    D2H -> CPU step -> H2D overlapping it, a device tail step; returns the end time."""
    rec.add("device_compute", "forward", t0, t0 + 0.010, iteration=it)
    rec.add("device_compute", "backward", t0 + 0.010, t0 + 0.030, iteration=it)
    for b in range(buckets):
        s = t0 + 0.012 + 0.005 * b
        rec.add("d2h", "d2h", s, s + 0.002, iteration=it, bucket=b, nbytes=4 * MB)
        rec.add("cpu_optimizer", "cpu_step", s + 0.002, s + 0.004, iteration=it, bucket=b,
                nbytes=28 * MB)
        rec.add("h2d", "h2d", s + 0.004, s + 0.005, iteration=it, bucket=b, nbytes=2 * MB)
    rec.add("device_optimizer", "device_step", t0 + 0.030, t0 + 0.032, iteration=it, bucket=buckets)
    end = t0 + 0.032
    if rollback:
        rec.add("cpu_optimizer", "rollback", end, end + 0.002, iteration=it, bucket=0)
        end += 0.002
    if loss is not None:
        rec.scalar("loss", it, loss)
    if ratio is not None:
        rec.scalar("ratio", it, ratio)
    return end


def filled_recorder(iterations: int, **kw: Any) -> Recorder:
    rec = Recorder()
    t = 0.0
    for it in range(iterations):
        t = record_iteration(rec, it, t, **kw) + 0.001
    return rec


@dataclass
class FakeEngine:
    """What the widgets use of an engine: config, iteration, telemetry, reconfigure (and the
    optional `reconfigurable` and `closed` an engine may declare)."""

    config: OffloadConfig = field(default_factory=lambda: OffloadConfig(bucket_bytes=1 << 20))
    iteration: int = 0
    telemetry: Recorder = field(default_factory=Recorder)
    calls: list[dict[str, Any]] = field(default_factory=list)
    reconfigurable: frozenset[str] = RECONFIGURABLE
    closed: bool = False

    def reconfigure(self, **changes: Any) -> None:
        self.calls.append(dict(changes))
        self.config = self.config.replace(**changes)


class FakeShell:
    """Enough of ipykernel's shell for `_env`: a kernel, get_parent, set_thread_parent."""

    kernel = object()

    def __init__(self) -> None:
        self.parent = {"header": {"msg_id": "cell-1"}}
        self.thread_parents: list[tuple[str, Any]] = []

    def get_parent(self) -> Any:
        return self.parent

    def set_thread_parent(self, parent: Any) -> None:
        self.thread_parents.append((threading.current_thread().name, parent))


class FigureView:
    """Attribute access over a figure dict (widgets/shared/plotjson.py), as plotly's objects read:
    `FigureView(dash.figure).layout.yaxis.ticktext`, `.data[k].x`; a missing key reads None."""

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "_value", value)

    @staticmethod
    def wrap(value: Any) -> Any:
        return FigureView(value) if isinstance(value, (dict, list)) else value

    def __getattr__(self, name: str) -> Any:
        value = self._value
        if isinstance(value, dict):
            return FigureView.wrap(value.get(name))
        raise AttributeError(name)

    def __getitem__(self, key: Any) -> Any:
        value = self._value
        if isinstance(value, dict):
            return FigureView.wrap(value.get(key))
        return FigureView.wrap(value[key])

    def __len__(self) -> int:
        return len(self._value)

    def __iter__(self) -> Any:
        return (FigureView.wrap(v) for v in self._value)

    def __eq__(self, other: Any) -> bool:
        return bool(self._value == (other._value if isinstance(other, FigureView) else other))

    def __bool__(self) -> bool:
        return bool(self._value)

    def to_plotly_json(self) -> Any:
        return self._value
