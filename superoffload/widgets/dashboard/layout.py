"""Pure layout rules of the dashboard's figures: palettes, which panels, where they go.

No plotly here: the figure modules turn these numbers into axes, legends and annotations,
and the tests check them without a browser.

Colours: ONE colour per lane, wherever it appears. D2H is orange on the timeline and in the
link panel, H2D purple in both, the CPU optimizer green (its bars and "CPU step hidden"),
device compute blue (its bars and "device idle"). The run's own figures (iteration time,
engine time, prediction, loss, memory) have colours no lane uses; events (rollback, replay,
skipped step, reconfigure, does not fit) a third set, reference lines are grey or a light
tint of their lane's colour. A colour never means two things.

Measured layout (a live or recorded run), sized to fit one screen at 1366x768:
    one legend for the whole figure (a series has one colour everywhere: one entry each)
    timeline (ms inside the window, full width)
    iteration time | link GB/s | overlap and idle
    loss           | memory
Per-iteration panels share one x axis (iterations, or seconds of wall clock); a panel
without data is left out, and a person can hide any panel (`measured_panels(hidden=...)`).

Simulated layout (a planner result):
    timeline (ms inside the steady window)
    lane busy / exposed (ms) | link GB/s
    memory vs capacity (GB)
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
    "storage": "#2F4B7C",          # slate blue
}
"""One colour per lane: its timeline bars and every figure about that lane."""

LANE_OF_METRIC: dict[str, str] = {
    "d2h": "d2h", "h2d": "h2d", "overlap": "cpu_optimizer", "idle": "device_compute",
}
"""Metric lines that describe one lane, drawn in that lane's colour."""

RUN_COLORS: dict[str, str] = {
    "iteration_ms": "#1B1B1B",     # near black
    "engine_ms": "#8A8A8A",        # grey
    "predicted": "#8C6D31",        # brown (dashed)
    "d2h_peak": "#FBC58F",         # light orange (dotted): the planner's D2H rate
    "h2d_peak": "#D9BCD0",         # light purple (dotted): the planner's H2D rate
    "loss": "#D6336C",             # raspberry
    "host_mem": "#17BECF",         # cyan
    "device_mem": "#BCBD22",       # olive
}
"""Figures of the run that belong to no single lane."""

METRIC_COLORS: dict[str, str] = {**RUN_COLORS,
                                 **{k: LANE_COLORS[lane] for k, lane in LANE_OF_METRIC.items()}}
"""Every per-iteration line's colour (the HTML report and the simulated layout use these
too: D2H is orange and H2D purple everywhere, as on the timeline)."""

EVENT_COLORS: dict[str, str] = {
    "rollback": "#E41A1C",
    "replay": "#E6AB02",
    "skipped": "#000000",
    "reconfigure": "#6A3D9A",
    "not_fit": "#C00000",
}
"""Markers: rollback (x), replay (diamond), skipped step (square), reconfigure (dashed line)."""

RUN_DASHES = ("dash", "dot", "dashdot", "longdash")
"""Line styles of compared runs (the live run is solid; colour still says what is drawn)."""

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
    Panel("timeline", "timeline (last iterations)", "", ()),
    Panel("speed", "iteration time", "ms", ()),
    Panel("link", "link while moving", "GB/s (log)", ()),
    Panel("percent", "overlap and idle", "%", ()),
    Panel("loss", "loss", "nats", ()),
    Panel("memory", "memory", "GB", ()),
)}
"""Panels of the measured layout, in display order (timeline first, full width). A y title
is its metrics' unit (`telemetry.vocabulary`); the figure has one legend for all panels
(each series one entry, in its one colour), so panels carry titles only."""

PANEL_NAMES: dict[str, str] = {"timeline": "timeline", "speed": "time", "link": "link",
                               "percent": "overlap", "loss": "loss", "memory": "memory"}
"""Short names of the measured panels (the dashboard's show/hide toggles)."""

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


def measured_panels(available: set[str] | frozenset[str],
                    hidden: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The measured panels to draw: the timeline always, the others when they have data;
    none that a person hid."""
    unknown = set(hidden) - set(MEASURED)
    if unknown:
        raise ValueError(f"hidden panels {sorted(unknown)}: known panels are {list(MEASURED)}")
    return [k for k in MEASURED if (k == "timeline" or k in available) and k not in hidden]


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


@dataclass(frozen=True, slots=True)
class Sizes:
    """The pixel budget of a grid: plot-area heights, the bands around them, columns."""

    timeline_px: int = TIMELINE_PX
    row_px: int = ROW_PX
    header_px: int = HEADER_PX
    ticks_px: int = TICKS_PX
    top_px: int = TOP_PX
    columns: int = 2
    h_gap: float = H_GAP


MEASURED_SIZES = Sizes(timeline_px=84, row_px=88, header_px=20, ticks_px=28, top_px=26,
                       columns=3, h_gap=0.06)
"""The measured layout: three columns and short plot areas, so that the status line, the
controls and the figure fit one screen at 1366x768 (the browser test measures it). Its one
legend sits above the timeline (`legend_px`)."""
LEGEND_LINE_PX = 19
"""One line of the figure's legend (11 px font)."""


def grid(panels: Sequence[str], *, full_width: Sequence[str] = ("timeline",),
         heights: dict[str, int] | None = None, sizes: Sizes = Sizes(),
         legend_px: int = 0) -> Grid:
    """Rows from the top: each full-width panel alone, the others `sizes.columns` per row (a
    short last row keeps the column width, so every per-iteration panel has the same x scale
    length). `heights` overrides the plot-area height (px) of a row holding that panel;
    `legend_px` reserves a band under the title for a figure-wide legend."""
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
            if len(pending) == sizes.columns:
                rows.append(pending)
                pending = []
    if pending:
        rows.append(pending)
    heights = heights or {}

    def row_height(row: list[str]) -> int:
        given = [heights[k] for k in row if k in heights]
        if given:
            return max(given)
        return sizes.timeline_px if row[0] == "timeline" else sizes.row_px

    row_heights = [row_height(row) for row in rows]
    top = sizes.top_px + legend_px
    total = top + sum(sizes.header_px + h + sizes.ticks_px for h in row_heights)
    domains: dict[str, Domain] = {}
    bottom: set[str] = set()
    y_px = total - top
    width = (1.0 - sizes.h_gap * (sizes.columns - 1)) / sizes.columns
    for r, (row, h) in enumerate(zip(rows, row_heights)):
        row_top = y_px - sizes.header_px
        bottom_px = row_top - h
        y = (round(bottom_px / total, 4), round(row_top / total, 4))
        if row[0] in full_width:
            domains[row[0]] = Domain((0.0, 1.0), y)
        else:
            for c, key in enumerate(row):
                x0 = c * (width + sizes.h_gap)
                domains[key] = Domain((round(x0, 4), round(x0 + width, 4)), y)
        for c, key in enumerate(row):
            below = [rr for rr in rows[r + 1:] if len(rr) > c and rr[0] not in full_width]
            if not below:
                bottom.add(key)
        y_px = bottom_px - sizes.ticks_px
    return Grid(height_px=int(total), domains=domains, bottom_row=frozenset(bottom))


CHAR_PX = 6.5       # 11-12 px sans-serif: average glyph width
LEGEND_ITEM_PX = 40  # symbol and padding of one horizontal legend entry


def legend_width_px(entries: Sequence[str]) -> float:
    """Estimated width of a one-line horizontal legend."""
    return sum(LEGEND_ITEM_PX + CHAR_PX * len(e) for e in entries)


def legend_lines(entries: Sequence[str], width_px: float) -> int:
    """Lines a horizontal legend of `entries` wraps onto at plot width `width_px` (plotly
    starts a new line when the next entry does not fit)."""
    lines, used = 1, 0.0
    for e in entries:
        w = LEGEND_ITEM_PX + CHAR_PX * len(e)
        if used and used + w > width_px:
            lines, used = lines + 1, 0.0
        used += w
    return lines


def legends_fit(layout: dict[str, Panel], domains: dict[str, Domain], width_px: float) -> list[str]:
    """Panels whose legend would not fit on one line at figure width `width_px` (the
    browser test checks the rendered boxes; this catches a too-long name without one)."""
    # left/right margins
    plot_px = width_px - 80
    return [k for k, d in domains.items()
            if legend_width_px(layout[k].legend) > (d.x[1] - d.x[0]) * plot_px]


MIN_WIDTH_PX = 900
"""The narrowest output area the layout is designed for (JupyterLab at 1400 px with the file
browser open gives ~970 px); narrower, a legend may wrap onto a second line."""
