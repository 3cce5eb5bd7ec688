"""What each setting changes against the one in force, and the predicted time over the ratio
(docs/jupyter.md, "The offload tuner"): the tuner's comparison table and its small curve.
Pure (planner calls and strings): no widgets.

"change vs in force" of a field is the planner's predicted iteration time with only that
field moved to the control's value, relative to the settings in force (the engine's, or the
tuner's starting config in what-if mode); the last row moves them all. The curve is the
predicted time at ratios 0, 0.1, ..., 1 with everything else as the controls say, so a flat
line shows at a glance that the ratio barely matters (a tiny model on a CPU, whose CPU
step is microseconds).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

from superoffload.config import OffloadConfig

CURVE_RATIOS = tuple(i / 10 for i in range(11))


@dataclass(frozen=True, slots=True)
class ChangeRow:
    field: str
    in_force: Any
    wanted: Any
    change: float | None
    """Predicted new / in force - 1 with only this field changed (None: does not fit)."""


def _time(shape: Any, profile: Any, config: OffloadConfig) -> float | None:
    from superoffload import plan

    res = plan.simulate(shape, profile, system="superoffload", config=config)
    return float(res.iteration_s) if res.fits else None


def change_rows(shape: Any, profile: Any, in_force: OffloadConfig, wanted: OffloadConfig,
                fields: tuple[str, ...]) -> list[ChangeRow]:
    """One row per field of `fields` whose value differs, then "all" (module docstring)."""
    base = _time(shape, profile, in_force)
    rows = []
    moved = {f: getattr(wanted, f) for f in fields if getattr(wanted, f) != getattr(in_force, f)}
    for name, value in moved.items():
        t = _time(shape, profile, in_force.replace(**{name: value}))
        rows.append(ChangeRow(name, getattr(in_force, name), value,
                              None if t is None or base is None else t / base - 1.0))
    if len(moved) > 1:
        t = _time(shape, profile, in_force.replace(**moved))
        rows.append(ChangeRow("all", "", "", None if t is None or base is None else t / base - 1))
    return rows


def ratio_curve(shape: Any, profile: Any, config: OffloadConfig,
                ratios: tuple[float, ...] = CURVE_RATIOS) -> list[tuple[float, float | None]]:
    """(ratio, predicted seconds or None where it does not fit) with `config`'s other fields."""
    return [(r, _time(shape, profile, config.replace(ratio=r))) for r in ratios]


def curve_summary(curve: list[tuple[float, float | None]]) -> str:
    """"over ratio 0-1 the prediction moves 0.4% (10.2-10.3 ms)": why a slider matters."""
    ts = [t for _, t in curve if t is not None]
    if not ts:
        return "no ratio fits memory"
    lo, hi = min(ts), max(ts)
    return (f"over ratio 0-1 the predicted time moves {hi / lo - 1:.1%} "
            f"({lo * 1e3:.3g}-{hi * 1e3:.3g} ms)")


def change_table_html(rows: list[ChangeRow]) -> str:
    if not rows:
        return "<div class='so-tuner-changes'>controls match the settings in force</div>"
    cells = []
    for r in rows:
        change = "does not fit" if r.change is None else f"{r.change:+.1%}"
        what = "all changes" if r.field == "all" else f"{r.field}: {r.in_force} \u2192 {r.wanted}"
        cells.append(f"<tr><td style='padding-right:12px'>{html.escape(what, quote=False)}</td>"
                     f"<td>{html.escape(change)}</td></tr>")
    return ("<table class='so-tuner-changes' style='border-collapse:collapse'><tr><th "
            "style='text-align:left'>predicted change vs in force</th><th></th></tr>"
            + "".join(cells) + "</table>")


def curve_svg(curve: list[tuple[float, float | None]], current: float, *, width: int = 220,
              height: int = 60) -> str:
    """A small inline SVG: predicted ms over the ratio, the current ratio marked."""
    pts = [(r, t) for r, t in curve if t is not None and math.isfinite(t)]
    if len(pts) < 2:
        return ""
    ts = [t for _, t in pts]
    lo, hi = min(ts), max(ts)
    # a flat line is drawn flat
    span = hi - lo if hi > lo else max(hi, 1e-12) * 0.01

    def xy(r: float, t: float) -> tuple[float, float]:
        return 4 + r * (width - 8), height - 14 - (t - lo) / span * (height - 24)

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(r, t) for r, t in pts))
    cx = 4 + current * (width - 8)
    return (f"<svg class='so-tuner-curve' width='{width}' height='{height}' role='img' "
            f"aria-label='predicted iteration time over the ratio'>"
            f"<polyline points='{path}' fill='none' stroke='#1f77b4' stroke-width='1.5'/>"
            f"<line x1='{cx:.1f}' x2='{cx:.1f}' y1='2' y2='{height - 12}' stroke='#d62728'/>"
            f"<text x='2' y='{height - 1}' font-size='9'>ratio 0</text>"
            f"<text x='{width - 34}' y='{height - 1}' font-size='9'>ratio 1</text>"
            f"<text x='2' y='9' font-size='9'>{hi * 1e3:.3g} ms</text></svg>")
