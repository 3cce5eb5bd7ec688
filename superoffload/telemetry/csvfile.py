"""A run's per-iteration series as CSV: every figure the dashboard draws, one row per iteration.

    text = metrics_csv(iteration_metrics(spans), scalars={"loss": [(0, 5.5), ...]})

Columns: `iteration`, `iterations` (how many the row stands for: 1, or a bin's count), `time_s`
(seconds since the first iteration started, the dashboard's wall-clock axis), every
per-iteration metric of `telemetry.vocabulary` under its name (the unit is the name's: `_ms`,
`_gbps_`, `_pct`), then each scalar named in `scalars` ("loss", "ratio", ...; empty where that
iteration has none). One row per iteration for every iteration given; the start of a run longer
than the recorder's buffer comes from its archive (telemetry/archive.py), one row per bin, its
figures pooled (each bin's weighted mean is its pooled figure, `telemetry.window`) and its
scalars averaged: the whole run at any length, the start binned, never dropped.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence

import numpy as np

from superoffload.telemetry.archive import TIME_KEY, IterationArchive
from superoffload.telemetry.metrics import IterationMetrics
from superoffload.telemetry.vocabulary import PER_ITERATION, iteration_values


def metrics_csv(ms: Sequence[IterationMetrics],
                scalars: Mapping[str, Sequence[tuple[int, float]]] | None = None, *,
                archive: IterationArchive | None = None) -> str:
    """The CSV text (module docstring); NaN figures are empty cells."""
    scalars = scalars or {}
    by_name = {name: dict(values) for name, values in scalars.items()}
    names = list(by_name)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["iteration", "iterations", "time_s", *PER_ITERATION, *names])
    starts = [m.start_s for m in ms[:1]]
    if archive is not None and archive.iterations:
        starts.append(float(np.nanmin(archive.series[TIME_KEY].arrays()["min"])))
    t0 = min(starts, default=0.0)
    done = -1
    if archive is not None and archive.iterations:
        done = archive.last_iteration
        for row in _archived_rows(archive, by_name, names, t0):
            writer.writerow(row)
    for m in ms:
        if m.iteration <= done:
            continue
        values = iteration_values(m)
        row = [m.iteration, 1, _cell(m.start_s - t0)]
        row += [_cell(values[name]) for name in PER_ITERATION]
        row += [_cell(by_name.get(name, {}).get(m.iteration, math.nan)) for name in names]
        writer.writerow(row)
    return out.getvalue()


def _archived_rows(archive: IterationArchive, by_name: Mapping[str, Mapping[int, float]],
                   names: Sequence[str], t0: float) -> list[list[object]]:
    cols = {name: archive.series[name].arrays() for name in (*PER_ITERATION, TIME_KEY)}
    grid = cols[TIME_KEY]
    extra = {n: archive.scalars[n].arrays() for n in names if n in archive.scalars}
    rows: list[list[object]] = []
    for k in range(len(grid["first"])):
        first, last = int(grid["first"][k]), int(grid["last"][k])
        row: list[object] = [first, int(grid["n"][k]), _cell(grid["mean"][k] - t0)]
        row += [_cell(cols[name]["mean"][k]) for name in PER_ITERATION]
        for name in names:
            total, count = 0.0, 0.0
            binned = extra.get(name)
            if binned is not None:
                sel = (binned["first"] >= first) & (binned["first"] <= last)
                ok = sel & np.isfinite(binned["mean"])
                total += float(np.sum(binned["mean"][ok] * binned["n"][ok]))
                count += float(np.sum(binned["n"][ok]))
            held = [v for i, v in by_name.get(name, {}).items() if first <= i <= last]
            total, count = total + sum(held), count + len(held)
            row.append(_cell(total / count if count else math.nan))
        rows.append(row)
    return rows


def _cell(value: float) -> str:
    return "" if value is None or math.isnan(value) else repr(float(value))
