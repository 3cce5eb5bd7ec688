"""Changing the engine's settings while it trains (``engine.reconfigure``, the tuner's Apply).

Which fields may change, and how, is declared once on ``OffloadConfig``'s fields
(config.py: ``live="live" | "replan" | "forward"``). A request is validated in the caller's
thread (a widget's), stored, and applied by the training thread where the next iteration
starts: "live" fields at once, "replan" fields after draining the lanes and rebuilding the
buckets from the current state, "forward" fields (the weight policy) where the next
forward starts (runtime/weight_policy.py). Every applied change leaves a telemetry note.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from superoffload.config import FORWARD_FIELDS, REPLAN_FIELDS, ConfigError, OffloadConfig
from superoffload.runtime.iteration import EngineStats
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.weight_policy import WeightPolicyController
from superoffload.telemetry.recorder import Recorder


class ReconfigureHost(Protocol):
    config: OffloadConfig
    telemetry: Recorder
    adaptive: AdaptiveSTV
    iteration: int

    @property
    def reconfigurable(self) -> frozenset[str]: ...

    def synchronize(self) -> None: ...

    def rebuild(self) -> None: ...

    def refresh_schedule(self) -> None:
        """Re-resolve the schedule for changed "live" fields (threads) without re-planning."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def weights(self) -> WeightPolicyController: ...


class Reconfigurer:
    """Pending changes of one engine (thread-safe)."""

    def __init__(self, host: ReconfigureHost) -> None:
        self.host = host
        self._lock = threading.Lock()
        self.pending: dict[str, Any] = {}
        """Changes requested, applied at the next iteration boundary (the engine checks this
        plain attribute before calling ``apply_pending``)."""

    def request(self, changes: dict[str, Any]) -> None:
        """Validate now (raise ConfigError naming the field); apply at the next iteration."""
        allowed = self.host.reconfigurable
        for key in changes:
            if key not in allowed:
                where = ("this engine changes nothing while training (data parallel: every "
                         "rank would have to apply it at the same iteration); rebuild it")
                if allowed:
                    where = f"changeable: {', '.join(sorted(allowed))}"
                raise ConfigError(f"reconfigure({key}=...): not changeable while training; {where}")
        with self._lock:
            merged = {**self.pending, **changes}
            # validate in the caller's thread
            self.host.config.replace(**merged)
            weights = {k: merged.pop(k) for k in FORWARD_FIELDS & merged.keys()}
            self.pending = merged
        if weights:
            # applied where the next forward starts
            self.host.weights.request(weights)

    def apply_pending(self) -> None:
        """At an iteration boundary, in the training thread."""
        with self._lock:
            changes, self.pending = self.pending, {}
        if not changes:
            return
        host = self.host
        old = host.config
        new = old.replace(**changes)
        host.config = new
        if REPLAN_FIELDS & changes.keys():
            host.synchronize()
            host.rebuild()
        else:
            host.refresh_schedule()
        host.adaptive.configure(mode=new.speculation, window=new.adaptive_window,
                                threshold=new.adaptive_threshold)
        host.stats.reconfigurations += 1
        diff = ", ".join(f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in sorted(changes))
        host.telemetry.note(host.iteration, f"reconfigure applied: {diff}")
