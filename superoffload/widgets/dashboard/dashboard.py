"""`LiveDashboard`: a live view of the engine's telemetry, or of a finished run, or of a
simulated one (`show_simulation`).

    dash = LiveDashboard(engine, shape=model, seq=64, micro_batch=8)   # prediction beside
    dash                              # last expression of a cell: status, controls, figure
    BackgroundTrainer(step_fn, dashboard=dash).start()   # refreshes a few times a second
    dash.set_view(smoothing=0.6, x_axis="wall clock", hidden={"memory"})
    dash.compare("runs/baseline")     # a saved run on the same axes (or BEFORE_AFTER)
    dash.save_run("runs/this-one"); dash.to_csv("metrics.csv"); dash.to_html("dashboard.html")

Measured runs get the measured layout (`figure.py`), simulated results the simulated one
(`simulation.py`). A live dashboard is one box (`box.py`): a status line, a row of controls
(`toolbar.py`) and the live figure (widgets/shared/liveplot.py), fitting one screen at
1366x768. A refresh costs the training host little (docs/jupyter.md, "What the dashboard
costs"): it reads what the recorder got since the last one (`feed.py`), updates bins, writes
the figure's arrays into plain dicts and sends them as binary frames when they changed, on the
refresher's thread (widgets/shared/refresher.py), at `refresh_hz` or slower. When the run ends
(and when the kernel shuts down) the box is replaced in place by a static figure of the whole
recorded run (`whole_run.py`, widgets/shared/slots.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from superoffload.widgets.dashboard import exports
from superoffload.widgets.dashboard.box import LiveBox
from superoffload.widgets.dashboard.compare import Comparison
from superoffload.widgets.dashboard.expected import Expected, GapWatch
from superoffload.widgets.dashboard.feed import Feed
from superoffload.widgets.dashboard.figure import PLOT_CONFIG, build_figure, write_state
from superoffload.widgets.dashboard.options import ViewOptions
from superoffload.widgets.dashboard.prediction import Predictor
from superoffload.widgets.dashboard.sources import is_recorder, resolve_source
from superoffload.widgets.dashboard.state import DashboardState
from superoffload.widgets.dashboard.status import STATUS_HEAD, Workload, rank_lines, status_lines
from superoffload.widgets.dashboard.toolbar import Toolbar
from superoffload.widgets.dashboard.whole_run import PAGE_POINTS, STATIC_POINTS, static_figure
from superoffload.widgets.shared import env as _env
from superoffload.widgets.shared import owners
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.profile import ProfileChoice, resolve_profile, to_shape
from superoffload.widgets.shared.refresher import Refresher, check_hz
from superoffload.widgets.shared.runstate import RunState

FROM_SPANS_WINDOW = 50
"""At most this many iterations on a static dashboard's timeline (`from_spans`)."""
RUNS_EVERY_S = 5.0
"""Seconds between two readings of runs/ for the compare menu (a run saved elsewhere)."""


class LiveDashboard:
    """Status, controls and figure of a run (module docstring); spans of several ranks get
    per-rank lanes (`from_spans(telemetry.ranks.merge_rank_spans([...]))`)."""

    def __init__(self, source: Any = None, *, shape: Any = None, seq: int | None = None,
                 micro_batch: int = 1, profile: Any = None, window_iterations: int = 4,
                 refresh_hz: float = 2.0, live: bool | None = None,
                 title: str = "superoffload", calibrate_after: int | None = 10,
                 runs_dir: str | Path = "runs") -> None:
        self.engine, self.recorder = resolve_source(source)
        self.refresh_hz = check_hz(refresh_hz, "refresh_hz")
        self.base_title = title
        self.state = DashboardState(window_iterations=window_iterations)
        self.live = _env.live_widgets_available() if live is None else bool(live)
        if self.live and not _env.live_widgets_available():
            raise _env.WidgetsUnavailable(
                f"live=True needs {', '.join(_env.missing_for_live())}: {_env.INSTALL_HINT}")
        self.shape = (to_shape(shape, seq=seq, micro_batch=micro_batch)
                      if shape is not None else None)
        want_profile = profile is not None or self.shape is not None or self.engine is not None
        choice = resolve_profile(profile) if want_profile else None
        self.predictor = Predictor(self.engine, self.recorder, self.shape, choice,
                                   calibrate_after=calibrate_after,
                                   measured_here=choice is not None and choice.of_this_machine)
        self.run_state: RunState | None = None
        self.simulation: Any = None
        self.sim: Any = None
        """The simulated layout's figures (`simulation.SimFigures`) after `show_simulation`."""
        self.figure: dict[str, Any] = build_figure(title=title)
        """The figure as plain data (`figure.build_figure`, widgets/shared/plotjson.py)."""
        self.view = ViewOptions()
        """Hidden panels, smoothing, x axis (`set_view`; the toolbar's controls)."""
        self.comparison = Comparison()
        """Runs drawn beside this one (`compare`)."""
        self.runs_dir = Path(runs_dir)
        self.toolbar: Any = (Toolbar(self, runs_dir) if self.live and self.recorder is not None
                             else None)
        self.box: LiveBox | None = (LiveBox(PLOT_CONFIG, self.toolbar.box)
                                    if self.toolbar is not None else None)
        self.status: Any = self.box.status if self.box is not None else None
        self.plot: Any = self.box.plot if self.box is not None else None
        self.widget = self.box.box if self.box is not None else None
        self.refreshes = 0
        self.gaps = GapWatch()
        """The prediction-gap warning, held steady (`expected.GapWatch`)."""
        self._main = snap.OutputSlot("dashboard")
        self._feed = Feed(self.recorder) if self.recorder is not None else None
        self._lock = threading.RLock()
        self._runs_listed = time.monotonic()
        self._refresher = Refresher(self.refresh, self.refresh_hz, name="superoffload dashboard",
                                    busy=self._lanes_busy)

    # ----------------------------------------------------------------- sources
    @classmethod
    def from_spans(cls, source: Any, *, title: str = "timeline", **kw: Any) -> LiveDashboard:
        """A static dashboard of a finished run (spans, e.g. several ranks merged, or a
        Recorder with its notes and scalars): the last `FROM_SPANS_WINDOW` on the timeline."""
        kw.setdefault("live", False)
        if isinstance(source, Iterable) and not is_recorder(source):
            spans = list(source)
            kw.setdefault("window_iterations",
                          max(1, min(FROM_SPANS_WINDOW, len({s.iteration for s in spans}))))
            dash = cls(None, title=title, **kw)
            dash.state.add_spans(spans, final=True)
        else:
            kw.setdefault("window_iterations",
                          max(1, min(FROM_SPANS_WINDOW, len(source.iterations()))))
            dash = cls(source, title=title, **kw)
            dash.refresh(final=True)
        dash.run_state = RunState.FINISHED
        dash._redraw()
        return dash

    def show_simulation(self, result: Any, *, title: str | None = None,
                        profile: Any = None) -> None:
        """Draw a planner result (`plan.simulate(...)`) in the simulated layout."""
        from superoffload.widgets.dashboard.simulation import build_sim_figure, sim_figures

        with self._lock:
            self.simulation = result
            self.sim = sim_figures(result, profile)
            self.state = DashboardState(window_iterations=self.state.window_iterations)
            self.state.add_spans(self.sim.spans, final=True)
            self.base_title = title or self.sim.title
            if _env.plotly_available():
                self.figure = build_sim_figure(self.sim, title=self.base_title).to_dict()
                self._main.update(self._static_bundle())

    # ----------------------------------------------------------------- updates
    def refresh(self, *, final: bool = False) -> bool:
        """Pull new telemetry and redraw; True when something new arrived. Any thread."""
        if self._feed is None:
            return False
        with self._lock:
            new = self._feed.read(self.state, final=final)
            self.predictor.update(self.state)
            self._redraw()
            self.refreshes += 1
        if self.toolbar is not None and time.monotonic() - self._runs_listed >= RUNS_EVERY_S:
            self._runs_listed = time.monotonic()
            # a run saved meanwhile, elsewhere: in the menu now
            self.toolbar.refresh_runs()
        return new

    def _lanes_busy(self) -> bool:
        """An engine lane has a task queued or running (runtime/lanes.py): wait for a gap."""
        return any(getattr(lane, "busy", False) for lane in getattr(self.engine, "lanes", ()))

    @property
    def profile(self) -> ProfileChoice | None:
        return self.predictor.profile

    @property
    def work(self) -> Workload:  # tokens, FLOPs and the link of one step (`sources.workload`)
        return self.predictor.workload()

    @property
    def expected(self) -> list[Expected]:
        """The planner's prediction, a step per settings in force (`prediction.Predictor`)."""
        return self.predictor.expected

    @property
    def calibration(self) -> Any:
        """The last calibration on this run (`plan.autocal.CalibrationReport`), or None."""
        return self.predictor.calibration

    def calibrate(self) -> Any:
        """Fit the profile to this run's telemetry now and predict with it from the next
        iteration (`Predictor.calibrate`); returns the `plan.autocal.CalibrationReport`.
        The prediction-gap warning offers this line."""
        with self._lock:
            report = self.predictor.calibrate()
            self.predictor.update(self.state)
            self._redraw()
        return report

    def _redraw(self) -> None:
        lines = self.status_lines()
        if self.status is not None:
            self.status.value = snap.html_lines(lines, css_class="so-dash-status",
                                                fold_after=STATUS_HEAD)
        if self.simulation is None:
            # the live view's status line is its title; a figure that stays carries its own
            title = self.title_text() if self.plot is None else ""
            changed = write_state(self.figure, self.state, title, work=self.work,
                                  expected=self.expected, view=self.view,
                                  overlays=self.comparison.overlays(self.recorder, self.state))
            if self.box is not None:
                self.box.show(self.figure, lines, changed=changed,
                              has_data=self.state.plotted_rank is not None)

    def set_view(self, **changes: Any) -> ViewOptions:
        """Change how the figure is drawn (`options.ViewOptions`): hidden=panel keys,
        smoothing=0..0.999 (EMA of every per-iteration line), x_axis="iteration" or "wall
        clock"; redraws at once; returns the new options."""
        with self._lock:
            self.view = self.view.with_changes(**changes)
        self._changed()
        return self.view

    def compare(self, *sources: Any) -> list[str]:
        """Draw other runs beside this one, on the same axes, each from its own start: folders
        under runs/ (`save_run`, or `superoffload train`'s output), Recorders, engines, span
        lists, or `dashboard.compare.BEFORE_AFTER` (this run before and after its newest
        change of settings). No sources: compare with nothing. Returns the runs' labels."""
        with self._lock:
            self.comparison.set(sources)
        self._changed()
        return self.comparison.labels()

    def _changed(self) -> None:
        """The view or the comparison changed: redraw now, show it in the controls."""
        with self._lock:
            self._redraw()
        if self.toolbar is not None:
            self.toolbar.sync()

    def save_run(self, folder: str | Path | None = None, *, name: str | None = None) -> Path:
        """Keep this run under `folder` (default: a new folder under runs/ named after the
        title and the time) to compare with later (`telemetry.runfile.save_run`); the compare
        menu lists it at once; returns the folder."""
        out = exports.save_run(self.recorder, folder or exports.new_run_folder(
            self.runs_dir, self.base_title), name=name, title=self.base_title)
        if self.toolbar is not None:
            self.toolbar.sync()
        return out

    def csv_text(self) -> str:
        """Every per-iteration series of the whole run, its loss and ratio, as CSV: one row per
        iteration (past the recorder's buffer: per bin; `telemetry.csvfile`)."""
        return exports.csv_text(self.recorder, self.base_title)

    def to_csv(self, path: str | Path) -> Path:
        """Write `csv_text()` to `path`; returns the path."""
        return exports.write_text(path, self.csv_text())

    # ----------------------------------------------------------------- the run
    def set_run_state(self, state: RunState) -> None:
        """Told by the trainer; a run that ends gets a last refresh and its static figure."""
        self.run_state = state
        if state.ended:
            self.stop()
            self.refresh(final=True)
            self.finalize()
        else:
            self._redraw()

    def finalize(self, *, whole_run: bool = True) -> None:
        """Swap the live widget for the static figure of the whole run, in place (at the
        kernel's exit, `whole_run=False`: the live state's figure, at hand)."""
        with self._lock:
            if self._main.shown and whole_run:
                self._main.update(self._static_bundle())
            elif self._main.shown:  # at exit: one serialization, nothing sent to the live view
                write_state(self.figure, self.state, self.title_text(), work=self.work,
                            expected=self.expected, view=self.view)
                self._main.update(snap.figure_bundle(self.figure, self.status_lines(),
                                                     PLOT_CONFIG))
            if self.box is not None:
                self.box.end()
            snap.unregister(self)
        owners.release("refresh", self.recorder, self)

    def freeze(self) -> None:
        """At the kernel's exit: stop and finalize at once (the kernel may be killed seconds
        after its shutdown request: no second pass over the recording)."""
        self.stop(timeout_s=0.2)
        if self.run_state is RunState.RUNNING:
            self.run_state = RunState.STOPPED
        self.finalize(whole_run=False)

    def start(self, hz: float | None = None) -> LiveDashboard:
        """Refresh from a daemon thread until `stop()`; returns self. Another dashboard that
        refreshes this recorder (a re-run cell's) is stopped and frozen (owners.py)."""
        if hz is not None:
            self.refresh_hz = self._refresher.hz = check_hz(hz)
        if self.recorder is None:
            raise ValueError("this dashboard has no engine or recorder to follow (static view)")
        if self.running:
            return self
        previous = owners.claim("refresh", self.recorder, self)
        if previous is not None and previous.running:
            previous.stop()
            previous.finalize()
        if self._main.shown and self.box is not None and self._main.frozen:
            # a second run after the first one ended: the live figure comes back in place
            self.box.plot.ended = False
            self._main.update(snap.widget_bundle(self.box.box, self.status_lines()))
            snap.register(self)
        self._refresher.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the refresher thread (the caller refreshes once more if it wants)."""
        self._refresher.stop(timeout_s)

    running = property(lambda self: self._refresher.running, doc="The refresher runs.")
    error = property(lambda self: self._refresher.error, doc="What stopped the refresher.")

    # ----------------------------------------------------------------- reading
    def title_text(self) -> str:
        parts = [self.base_title]
        if self.run_state is not None and self.simulation is None:
            parts.append(self.run_state.value)
        it = self._engine_iteration()
        if it is None and self.state.newest_iteration >= 0:
            it = self.state.newest_iteration
        if it is not None and self.simulation is None:
            parts.append(f"iteration {it}")
        return " · ".join(parts)

    def status_lines(self, state: DashboardState | None = None) -> list[str]:
        """The status as plain-text lines (no markup)."""
        if self.simulation is not None:
            return [self.base_title, *(f"DOES NOT FIT: {p}" for p in self.sim.problems)]
        live = state is None
        state = state or self.state
        ratio = getattr(getattr(self.engine, "config", None), "ratio", None)
        failed = live and self.box is not None and self.box.failed()
        return status_lines(state, self.work, self.expected, run_state=self.run_state,
                            iteration=self._engine_iteration() if self.engine is not None
                            else state.newest_iteration,
                            ratio_fallback=float(ratio) if ratio is not None else None,
                            title=self.base_title, gaps=self.gaps if live else None,
                            notes=[LiveBox.fallback_line()] if failed else [],
                            calibration=self.calibration)

    def summary(self) -> str:
        """Plain-text summary (what a terminal sees instead of the figure): the status, one
        line per rank when several trained, the spans drawn."""
        lines = [*self.status_lines(), *rank_lines(self.state),
                 f"timeline: {len(self.state.timeline_spans())} spans drawn"]
        return "\n".join(lines)

    def _engine_iteration(self) -> int | None:
        value = getattr(self.engine, "iteration", None)
        return int(value) if isinstance(value, (int, float)) else None

    # ----------------------------------------------------------------- display
    def static_figure(self, max_points: int = STATIC_POINTS) -> tuple[dict[str, Any], list[str]]:
        """(figure dict, status lines) of the whole recorded run, drawn again from the
        recorder (`whole_run.static_figure`; a simulation: its own figure)."""
        if self.simulation is not None or self.recorder is None:
            return self.figure, self.status_lines()
        with self._lock:
            return static_figure(self, max_points)

    def _static_bundle(self) -> dict[str, Any]:
        fig, lines = self.static_figure()
        return snap.figure_bundle(fig, lines, PLOT_CONFIG)

    def _ipython_display_(self) -> None:
        self.display()

    def display(self) -> None:
        """Show the dashboard in a notebook; degrade with a message elsewhere."""
        if not _env.plotly_available():
            print(f"[superoffload] dashboard needs plotly to draw: {_env.INSTALL_HINT}")
            print(self.summary())
            return
        if not _env.in_notebook():
            print(self.summary())
            print("[superoffload] not in a notebook: dash.to_html('dashboard.html') writes a "
                  "static page")
            return
        live = self.box is not None and not (self.run_state is not None and self.run_state.ended)
        if live and self.box is not None:
            self._main.show(snap.widget_bundle(self.box.box, self.status_lines()))
            self.box.mark_shown()
            snap.register(self)
        else:
            if self.recorder is not None and not self.live and _env.missing_for_live():
                print(f"[superoffload] live widgets need {', '.join(_env.missing_for_live())}: "
                      f"showing a static snapshot. {_env.INSTALL_HINT}")
            self._main.show(self._static_bundle())

    def to_html(self, path: str | Path, *, include_plotlyjs: bool | str = True,
                max_points: int = PAGE_POINTS) -> Path:
        """Write the whole run as a self-contained HTML page (plotly.js embedded, so it opens
        offline; drawn from the recorder, not the live view); returns the path."""
        _env.require_plotly("LiveDashboard.to_html")
        fig, lines = self.static_figure(max_points)
        return exports.write_text(path, exports.page(fig, lines, self.base_title,
                                                     include_plotlyjs=include_plotlyjs,
                                                     config=PLOT_CONFIG))
