"""Figures of a whole recorded run, drawn from the recorder, not from the live view's state.

The live dashboard keeps a bounded state (`state.DashboardState`, a few hundred bins per
line) because it redraws a few times a second. A figure that stays (the static snapshot that
replaces the widget when the run ends, `dash.to_html`, the HTML report) is built once, so it
re-reads the recorder: the binned start of the run (`Recorder.whole_run`: iterations whose
spans left the recorder's bounded buffer, telemetry/archive.py) and every span and scalar
still held, binned at a finer bound (`STATIC_POINTS`; each bin keeps its minimum and
maximum). At any length the figure starts at the run's first iteration. Memory samples exist
only in the live state (they are sampled, not recorded) and are copied from it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from superoffload.telemetry.archive import IterationArchive
from superoffload.telemetry.events import Span
from superoffload.widgets.dashboard.figure import build_figure, write_state
from superoffload.widgets.dashboard.state import SCALARS, DashboardState

STATIC_POINTS = 1000
"""Bins per line in a figure that stays (the end-of-run snapshot kept in the notebook)."""
PAGE_POINTS = 2000
"""Bins per line in an exported page (`to_html`, the report)."""


def state_from(spans: Iterable[Span], scalars: Mapping[str, Iterable[tuple[int, float]]],
               notes: Sequence[tuple[int, str]], *, window_iterations: int,
               max_points: int, archive: IterationArchive | None = None) -> DashboardState:
    """A final `DashboardState` of a whole run: the `archive` of its start (if any), every
    span, the notes and the scalars the dashboard draws ({name: [(iteration, value), ...]},
    `state.SCALARS`)."""
    state = DashboardState(window_iterations=window_iterations, max_points=max_points)
    if archive is not None:
        state.add_archive(archive)
    for name in SCALARS:
        state.add_scalars(name, scalars.get(name, ()))
    state.add_notes(notes)
    state.add_spans(spans, final=True)
    return state


def state_from_recorder(recorder: Any, *, window_iterations: int, max_points: int = STATIC_POINTS,
                        live: DashboardState | None = None) -> DashboardState:
    """A final `DashboardState` of the whole run `recorder` recorded (module docstring)."""
    archive, spans = recorder.whole_run()
    scalars = {name: [(s.iteration, s.value) for s in recorder.scalars(name)] for name in SCALARS}
    state = state_from(spans, scalars, [(n.iteration, n.text) for n in recorder.notes()],
                       window_iterations=window_iterations, max_points=max_points,
                       archive=archive)
    if live is not None:
        state.host_mem_gb = copy.deepcopy(live.host_mem_gb)
        state.device_mem_gb = copy.deepcopy(live.device_mem_gb)
    return state


def static_figure(dash: Any, max_points: int = STATIC_POINTS) -> tuple[dict[str, Any], list[str]]:
    """(figure dict, status lines) of the whole run `dash` (a `LiveDashboard`) follows, drawn
    again from its recorder as its live figure is drawn: its view, prediction and compared
    runs; the live state gives the memory samples."""
    state = state_from_recorder(dash.recorder, window_iterations=dash.state.window_iterations,
                                max_points=max_points, live=dash.state)
    fig = build_figure(title=dash.base_title)
    write_state(fig, state, dash.title_text(), work=dash.work, expected=dash.expected,
                view=dash.view, overlays=dash.comparison.overlays(dash.recorder, state))
    return fig, dash.status_lines(state)
