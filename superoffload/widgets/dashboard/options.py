"""How a person has set the dashboard's figure: hidden panels, smoothing, the x axis.

Pure: the toolbar (`widgets/dashboard/toolbar.py`) writes a `ViewOptions`, the figure
(`figure.write_state`) reads it, and a static snapshot keeps the view that was on screen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.smoothing import check_weight

X_AXES = ("iteration", "wall clock")
"""The per-iteration panels' x axis: iterations, or seconds since the run started."""


@dataclass(frozen=True, slots=True)
class ViewOptions:
    """The dashboard's view settings (validated on construction)."""

    hidden: frozenset[str] = field(default_factory=frozenset)
    """Measured panels not drawn (`layout.MEASURED` keys; the timeline can be hidden too)."""
    smoothing: float = 0.0
    """EMA weight of every per-iteration line, 0 (none) to 0.999 (`smoothing.ema`)."""
    x_axis: str = "iteration"
    """One of `X_AXES`."""

    def __post_init__(self) -> None:
        unknown = set(self.hidden) - set(L.MEASURED)
        if unknown:
            raise ValueError(f"hidden={sorted(unknown)}: panels are {list(L.MEASURED)}")
        check_weight(self.smoothing)
        if self.x_axis not in X_AXES:
            raise ValueError(f"x_axis={self.x_axis!r}: use one of {X_AXES}")

    def with_changes(self, **changes: Any) -> ViewOptions:
        """A validated copy with `changes` (hidden may be any iterable of panel keys)."""
        if "hidden" in changes:
            changes["hidden"] = frozenset(changes["hidden"])
        return replace(self, **changes)

    @property
    def wall_clock(self) -> bool:
        return self.x_axis == "wall clock"

    def x_title(self, stride: int, comparing: bool) -> str:
        """The per-iteration panels' x title (bin width named when binned)."""
        base = "s since the run started" if self.wall_clock else "iteration"
        if comparing:
            base += " (each run from its own start)"
        if stride > 1:
            base += f" · bins of {stride}"
        return base
