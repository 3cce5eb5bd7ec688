"""Static figures drawn from the whole recorded run, not from the live view's state.

The live dashboard keeps a bounded state (`series.DashboardState`, a few hundred bins per
line) because it redraws a few times a second. A figure that stays (the static snapshot that
replaces the widget when the run ends, `dash.to_html`, the HTML report) is built once, so it
re-reads the recorder: every span and scalar still held, binned at a finer bound
(`STATIC_POINTS`; each bin keeps its minimum and maximum). Memory samples exist only in the
live state (they are sampled, not recorded) and are copied from it. If the recorder has
dropped the oldest spans (its bounded buffer, `Recorder(max_events=...)`), the live state,
which saw them, covers more of the run and is used instead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from superoffload.telemetry.events import Span
from superoffload.widgets.series import SCALARS, DashboardState

STATIC_POINTS = 1000
"""Bins per line in a figure that stays (the end-of-run snapshot kept in the notebook)."""
PAGE_POINTS = 2000
"""Bins per line in an exported page (`to_html`, the report)."""


def state_from(spans: Iterable[Span], scalars: Mapping[str, Iterable[tuple[int, float]]],
               notes: Sequence[tuple[int, str]], *, window_iterations: int,
               max_points: int) -> DashboardState:
    """A final `DashboardState` of a whole run: every span, the notes and the scalars the
    dashboard draws ({name: [(iteration, value), ...]}, `series.SCALARS`)."""
    state = DashboardState(window_iterations=window_iterations, max_points=max_points)
    for name in SCALARS:
        state.add_scalars(name, scalars.get(name, ()))
    state.add_notes(notes)
    state.add_spans(spans, final=True)
    return state


def state_from_recorder(recorder: Any, *, window_iterations: int, max_points: int = STATIC_POINTS,
                        live: DashboardState | None = None) -> DashboardState:
    """A final `DashboardState` of everything `recorder` holds (see the module docstring)."""
    scalars = {name: [(s.iteration, s.value) for s in recorder.scalars(name)] for name in SCALARS}
    state = state_from(recorder.spans(), scalars, [(n.iteration, n.text) for n in recorder.notes()],
                       window_iterations=window_iterations, max_points=max_points)
    if live is None:
        return state
    ours, theirs = state.coverage(), live.coverage()
    if theirs is not None and (ours is None or theirs[0] < ours[0]):
        return live  # the recorder lost the oldest iterations; the live bins still hold them
    state.host_mem_gb = copy.deepcopy(live.host_mem_gb)
    state.device_mem_gb = copy.deepcopy(live.device_mem_gb)
    return state
