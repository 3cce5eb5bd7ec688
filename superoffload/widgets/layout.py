"""Pure layout rules of the dashboard's figures: palettes, which panels, where they go.

No plotly here: the figure modules turn these numbers into axes, legends and annotations,
and the tests check them without a browser.

Palettes are disjoint on purpose: a colour means one thing. Lanes (what runs where) use one
palette, per-iteration metrics another, events (rollback, replay, skipped step, reconfigure,
does not fit) a third, and reference lines (link peak, capacity) are grey.

Measured layout (a live or recorded run):   Simulated layout (a planner result):
    timeline (ms inside the window)             timeline (ms inside the steady window)
    iteration time  | link GB/s                 lane busy / exposed (ms) | link GB/s
    percent         | loss                      memory vs capacity (GB)
    memory
Per-iteration panels share one x axis (iterations); a panel without data is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LANE_COLORS: dict[str, str] = {
    "device_compute": "#4C78A8",   # blue
    "d2h": "#F58518",              # orange
    "cpu_optimizer": "#54A24B",    # green
    "h2d": "#B279A2",              # purple
    "device_optimizer": "#72B7B2",  # teal
}
"""One colour per lane (timeline bars, lane bars of the simulated layout)."""

METRIC_COLORS: dict[str, str] = {
    "iteration_ms": "#1B1B1B",     # near black
    "engine_ms": "#636363",        # dark grey
    "predicted": "#8C6D31",        # brown (dashed)
    "d2h": "#D62728",              # red
    "h2d": "#1F77B4",              # strong blue
    "overlap": "#2CA02C",          # strong green
    "idle": "#7F7F7F",             # grey
    "d2h_peak": "#FF9896",         # light red (dotted): D2H's peak
    "h2d_peak": "#AEC7E8",         # light blue (dotted): H2D's peak
    "loss": "#9467BD",             # violet
    "host_mem": "#17BECF",         # cyan
    "device_mem": "#BCBD22",       # olive
}
"""Per-iteration metric lines (no colour shared with a lane). The HTML report and the
simulated layout use these too: D2H is red and H2D blue everywhere."""

EVENT_COLORS: dict[str, str] = {
    "rollback": "#E41A1C",
    "replay": "#FF7F00",
    "skipped": "#000000",
    "reconfigure": "#6A3D9A",
    "not_fit": "#C00000",
}
"""Markers: rollback (x), replay (diamond), skipped step (square), reconfigure (dashed line)."""

REFERENCE_COLOR = "#A0A0A0"
"""Reference lines: iteration boundaries, memory capacity."""


@dataclass(frozen=True, slots=True)
class Panel:
    key: str
    title: str
    y_title: str
    legend: tuple[str, ...]
    """Legend entries (short: a legend sits above its panel and must fit its width)."""


MEASURED: dict[str, Panel] = {p.key: p for p in (
    Panel("timeline", "timeline (last iterations)", "", ("rollback", "replay", "skipped step")),
    Panel("speed", "iteration time", "ms", ("iteration time", "engine time", "predicted")),
    Panel("link", "link while moving", "GB/s (log)", ("D2H", "H2D", "D2H peak", "H2D peak")),
    Panel("percent", "overlap and idle", "%", ("CPU step hidden", "device idle")),
    Panel("loss", "loss", "nats", ("loss",)),
    Panel("memory", "memory", "GB", ("host", "device")),
)}
"""Panels of the measured layout, in display order (timeline first, full width). A y title
is its metrics' unit (`telemetry.vocabulary`); legends name directions and kinds only,
the panel title and the hover text carry the rest of the metric's label."""

SIMULATED: dict[str, Panel] = {p.key: p for p in (
    Panel("timeline", "timeline (steady-state iteration)", "", ()),
    Panel("lanes", "busy and exposed time per lane (ms in the window)", "", ("busy", "exposed")),
    Panel("link", "link while moving", "GB/s", ("D2H peak", "H2D peak")),
    Panel("memory", "memory vs usable capacity", "", ("needed", "capacity")),
)}
"""Panels of the simulated layout, in display order."""

AXIS: dict[str, str] = {"timeline": "", "speed": "2", "link": "3", "percent": "4", "loss": "5",
                        "memory": "6"}
"""Axis suffix of each measured panel (x2/y2 ...): fixed, so traces never move between axes."""


def measured_panels(available: set[str] | frozenset[str]) -> list[str]:
    """The measured panels to draw: the timeline always, the others when they have data."""
    return [k for k in MEASURED if k == "timeline" or k in available]


@dataclass(frozen=True, slots=True)
class Domain:
    """Where a panel's plot area sits, as fractions of the figure (plotly's paper coords)."""

    x: tuple[float, float]
    y: tuple[float, float]


@dataclass(frozen=True, slots=True)
class Grid:
    height_px: int
    domains: dict[str, Domain]
    bottom_row: frozenset[str]
    """Panels in the lowest row of their column: they carry the x-axis title."""


TIMELINE_PX = 300
ROW_PX = 210
HEADER_PX = 50  # panel title + its legend (one line each), above the plot area
TICKS_PX = 40   # x tick labels and the axis title below a plot area
TOP_PX = 40     # figure title
H_GAP = 0.10    # between the two columns, as a fraction of the width


def grid(panels: Sequence[str], *, full_width: Sequence[str] = ("timeline",),
         heights: dict[str, int] | None = None, timeline_px: int = TIMELINE_PX,
         row_px: int = ROW_PX) -> Grid:
    """Rows from the top: each full-width panel alone, the others two per row (a lone last
    one keeps half the width, so every per-iteration panel has the same x scale length).
    `heights` overrides the plot-area height (px) of a row holding that panel."""
    rows: list[list[str]] = []
    pending: list[str] = []
    for key in panels:
        if key in full_width:
            if pending:
                rows.append(pending)
                pending = []
            rows.append([key])
        else:
            pending.append(key)
            if len(pending) == 2:
                rows.append(pending)
                pending = []
    if pending:
        rows.append(pending)
    heights = heights or {}

    def row_height(row: list[str]) -> int:
        given = [heights[k] for k in row if k in heights]
        if given:
            return max(given)
        return timeline_px if row[0] == "timeline" else row_px

    sizes = [row_height(row) for row in rows]
    total = TOP_PX + sum(HEADER_PX + h + TICKS_PX for h in sizes)
    domains: dict[str, Domain] = {}
    bottom: set[str] = set()
    y_px = total - TOP_PX
    for r, (row, h) in enumerate(zip(rows, sizes)):
        top = y_px - HEADER_PX
        bottom_px = top - h
        y = (round(bottom_px / total, 4), round(top / total, 4))
        if row[0] in full_width:
            domains[row[0]] = Domain((0.0, 1.0), y)
        else:
            half = (1.0 - H_GAP) / 2
            for c, key in enumerate(row):
                x0 = c * (half + H_GAP)
                domains[key] = Domain((round(x0, 4), round(x0 + half, 4)), y)
        for c, key in enumerate(row):
            below = [rr for rr in rows[r + 1:] if len(rr) > c and rr[0] not in full_width]
            if not below:
                bottom.add(key)
        y_px = bottom_px - TICKS_PX
    return Grid(height_px=int(total), domains=domains, bottom_row=frozenset(bottom))


CHAR_PX = 6.5       # 11-12 px sans-serif: average glyph width
LEGEND_ITEM_PX = 40  # symbol and padding of one horizontal legend entry


def legend_width_px(entries: Sequence[str]) -> float:
    """Estimated width of a one-line horizontal legend."""
    return sum(LEGEND_ITEM_PX + CHAR_PX * len(e) for e in entries)


def legends_fit(layout: dict[str, Panel], domains: dict[str, Domain], width_px: float) -> list[str]:
    """Panels whose legend would not fit on one line at figure width `width_px` (the
    browser test checks the rendered boxes; this catches a too-long name without one)."""
    plot_px = width_px - 80  # left/right margins
    return [k for k, d in domains.items()
            if legend_width_px(layout[k].legend) > (d.x[1] - d.x[0]) * plot_px]


MIN_WIDTH_PX = 900
"""The narrowest output area the layout is designed for (JupyterLab at 1400 px with the file
browser open gives ~970 px); narrower, a legend may wrap onto a second line."""
