"""One owner per run: a second start on the same engine stops the first.

A notebook cell can be run again while the run it started goes on: the old `trainer` and
`dash` names then point at new objects, the old run keeps training the same engine from its
thread (its Stop button was in the output that the re-run cleared), and two loops step one
engine. So each run is keyed by what it trains (the engine; a dashboard without an engine by
its recorder), and the newest start takes it over: the run that held the key is stopped
after its current step and its views are frozen, then the new one starts (`BackgroundTrainer.
start`, `LiveDashboard.start`). A run that does not stop within its timeout is not taken
over: the new start raises, naming the running one, and nothing is left half-replaced.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_owners: dict[tuple[str, int], tuple[Any, Any]] = {}
"""(kind, id(key)) -> (a weak reference to key, its owner). By identity: an engine need not
be hashable (a dataclass is not)."""
_lock = threading.Lock()


def _ref(key: Any) -> Any:
    try:
        return weakref.ref(key)
    except TypeError:
        # no weak references to it: held (a key is what a run trains: long-lived)
        return lambda: key


def _get(kind: str, key: Any) -> Any:
    entry = _owners.get((kind, id(key)))
    # gone, and its id reused
    if entry is None or entry[0]() is not key:
        return None
    return entry[1]


def owner_of(kind: str, key: Any) -> Any:
    """The object that holds `key` for `kind` ("training", "refresh"), or None."""
    with _lock:
        return _get(kind, key)


def claim(kind: str, key: Any, owner: Any) -> Any:
    """Make `owner` the holder of `key` for `kind`; returns the previous holder (None when
    there was none or it was `owner`). `key` None (nothing to key on): no ownership."""
    if key is None:
        return None
    with _lock:
        previous = _get(kind, key)
        _owners[(kind, id(key))] = (_ref(key), owner)
    return None if previous is owner else previous


def release(kind: str, key: Any, owner: Any) -> None:
    """`owner` lets go of `key` (no-op when another holds it now)."""
    if key is None:
        return
    with _lock:
        if _get(kind, key) is owner:
            del _owners[(kind, id(key))]


def run_key(*candidates: Any) -> Any:
    """What a run trains: the first engine among `candidates` (an engine, or a view with
    `.engine`), else the first recorder (`.recorder`); None when there is neither."""
    for c in candidates:
        engine = c if hasattr(c, "telemetry") else getattr(c, "engine", None)
        if engine is not None:
            return engine
    for c in candidates:
        recorder = getattr(c, "recorder", None)
        if recorder is not None:
            return recorder
    return None
