"""A run's per-iteration series as CSV: every figure the dashboard draws, one row per iteration.

    text = metrics_csv(iteration_metrics(spans), scalars={"loss": [(0, 5.5), ...]})

Columns: `iteration`, `time_s` (seconds since the first iteration started, the dashboard's
wall-clock axis), every per-iteration metric of `telemetry.vocabulary` under its name (the
unit is the name's: `_ms`, `_gbps_`, `_pct`), then each scalar given ("loss", "ratio", ...;
empty where that iteration has none). Full resolution: no binning, whatever the run's length.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence

from superoffload.telemetry.metrics import IterationMetrics
from superoffload.telemetry.vocabulary import PER_ITERATION, iteration_values


def metrics_csv(ms: Sequence[IterationMetrics],
                scalars: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> str:
    """The CSV text (module docstring); NaN figures are empty cells."""
    scalars = scalars or {}
    by_name = {name: dict(values) for name, values in scalars.items()}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["iteration", "time_s", *PER_ITERATION, *by_name])
    t0 = ms[0].start_s if ms else 0.0
    for m in ms:
        values = iteration_values(m)
        row = [m.iteration, _cell(m.start_s - t0)]
        row += [_cell(values[name]) for name in PER_ITERATION]
        row += [_cell(by_name[name].get(m.iteration, math.nan)) for name in by_name]
        writer.writerow(row)
    return out.getvalue()


def _cell(value: float) -> str:
    return "" if value is None or math.isnan(value) else repr(float(value))
