"""`LiveDashboard`: a live view of the engine's telemetry, or of a finished run, or of a
simulated one (`show_simulation`).

    dash = LiveDashboard(engine, shape=model, seq=64, micro_batch=8)   # prediction beside
    dash                              # last expression of a cell: status line + figure
    BackgroundTrainer(step_fn, dashboard=dash).start()   # refreshes a few times a second
    ...
    dash.to_html("artifacts/dashboard.html")

Measured runs get the measured layout (timeline in ms, iteration time measured vs predicted,
link GB/s while moving against the peak, percent, loss, memory: `figure.py`), simulated
results the simulated one (`simfigure.py`). A live dashboard shows its figure in one
`LivePlot` (liveplot.py: kernel -> browser only, so a busy kernel still hears the tuner),
created once (it ships ~5 MB of JavaScript); a refresh updates the figure's traces in place
and sends it when something changed, at `refresh_hz` or slower when a refresh takes long
(a loaded machine keeps its cores for training). When the run ends (and when the kernel
shuts down) the widget is replaced in place by a static figure drawn from the whole
recorded run (`fullstate.py`, snapshot.py), so a saved notebook reopens with the figure.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from superoffload.widgets import _env
from superoffload.widgets import snapshot as snap
from superoffload.widgets.figure import PLOT_CONFIG, build_figure, write_state
from superoffload.widgets.fullstate import PAGE_POINTS, STATIC_POINTS, state_from_recorder
from superoffload.widgets.live_view import live_view
from superoffload.widgets.panels import Expected, Workload, status_lines
from superoffload.widgets.predict import ProfileChoice, resolve_profile, to_shape
from superoffload.widgets.prediction import Predictor
from superoffload.widgets.runstate import RunState
from superoffload.widgets.series import SCALARS, DashboardState
from superoffload.widgets.sources import is_recorder, memory_bytes, resolve_source

SNAPSHOT_EVERY_S = 5.0
FROM_SPANS_WINDOW = 50
"""At most this many iterations on a static dashboard's timeline (`from_spans`)."""


class LiveDashboard:
    """Status line and figure of a run (see the module docstring). Spans of several ranks
    (`from_spans(telemetry.ranks.merge_rank_spans([...]))`) get per-rank lanes."""

    def __init__(self, source: Any = None, *, shape: Any = None, seq: int | None = None,
                 micro_batch: int = 1, profile: Any = None, window_iterations: int = 4,
                 refresh_hz: float = 2.0, live: bool | None = None,
                 title: str = "superoffload", calibrate_after: int | None = 10) -> None:
        if not refresh_hz > 0:
            raise ValueError(f"refresh_hz={refresh_hz} must be > 0 (refreshes per second, ~2-5)")
        self.engine, self.recorder = resolve_source(source)
        self.refresh_hz = float(refresh_hz)
        self.base_title = title
        self.state = DashboardState(window_iterations=window_iterations)
        self.live = _env.live_widgets_available() if live is None else bool(live)
        if self.live and not _env.live_widgets_available():
            raise _env.WidgetsUnavailable(
                f"live=True needs {', '.join(_env.missing_for_live())}: {_env.INSTALL_HINT}")
        self.shape = to_shape(shape, seq=seq, micro_batch=micro_batch) if shape is not None else None
        want_profile = profile is not None or self.shape is not None or self.engine is not None
        self.predictor = Predictor(
            self.engine, self.recorder, self.shape, resolve_profile(profile) if want_profile else None,
            calibrate_after=calibrate_after, measured_here=profile is None)
        self.run_state: RunState | None = None
        self.simulation: Any = None
        self.sim: Any = None
        """The simulated layout's figures (`simfigure.SimFigures`) after `show_simulation`."""
        self.figure: Any = build_figure(title=title) if _env.plotly_available() else None
        following = self.live and self.recorder is not None
        views: tuple[Any, Any, Any] = live_view(PLOT_CONFIG) if following else (None, None, None)
        self.status, self.plot, self.widget = views
        self.refreshes = 0
        self.error: BaseException | None = None
        self._main = snap.Slot("dashboard")
        self._snapshot = snap.Slot("dashboard-snapshot")
        self._last_snapshot = 0.0
        self._seq = -1
        self._scalar_t: dict[str, float] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- sources
    @classmethod
    def from_spans(cls, source: Any, *, title: str = "timeline", **kw: Any) -> LiveDashboard:
        """A static dashboard of a finished run: a list of spans (e.g. a merged multi-rank
        timeline) or a Recorder (its notes and scalars too), every iteration in the series,
        the last `FROM_SPANS_WINDOW` on the timeline."""
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

    def show_simulation(self, result: Any, *, title: str | None = None, profile: Any = None) -> None:
        """Draw a planner result (`plan.simulate(...)`) in the simulated layout."""
        from superoffload.widgets.simfigure import build_sim_figure, sim_figures

        with self._lock:
            self.simulation = result
            self.sim = sim_figures(result, profile)
            self.state = DashboardState(window_iterations=self.state.window_iterations)
            self.state.add_spans(self.sim.spans, final=True)
            self.base_title = title or self.sim.title
            if _env.plotly_available():
                self.figure = build_sim_figure(self.sim, title=self.base_title)
                self._main.update(self._static_bundle())

    # ----------------------------------------------------------------- updates
    def refresh(self, *, final: bool = False) -> bool:
        """Pull new telemetry and redraw; True when something new arrived. Any thread."""
        if self.recorder is None:
            return False
        with self._lock:
            spans, self._seq = self.recorder.spans_since(self._seq)
            fresh_scalars = False
            for name in SCALARS:
                fresh = [s for s in self.recorder.scalars(name)
                         if s.time_s > self._scalar_t.get(name, -1.0)]
                if fresh:
                    self._scalar_t[name] = fresh[-1].time_s
                    self.state.add_scalars(name, ((s.iteration, s.value) for s in fresh))
                    fresh_scalars = True
            self.state.add_notes([(n.iteration, n.text) for n in self.recorder.notes()])
            self.state.add_spans(spans, final=final)
            sampled = self.state.host_mem_gb.last_iteration
            if self.state.complete_through > (-1 if sampled is None else sampled):
                host, device = memory_bytes(self.recorder)  # one sample per complete iteration
                self.state.add_memory(self.state.complete_through, host, device)
            self.predictor.update(self.state)
            self._redraw()
            self.refreshes += 1
            return bool(spans) or fresh_scalars

    # ----------------------------------------------------------------- prediction
    @property
    def profile(self) -> ProfileChoice | None:
        return self.predictor.profile

    @property
    def expected(self) -> list[Expected]:
        """The planner's prediction, a step per settings in force (`prediction.Predictor`)."""
        return self.predictor.expected

    @property
    def work(self) -> Workload:
        return self.predictor.workload()

    @property
    def calibration(self) -> Any:
        """The last calibration on this run (`plan.autocal.CalibrationReport`), or None."""
        return self.predictor.calibration

    def use_calibration(self, report: Any) -> None:
        """Predict with the profile `report` fitted to this run (`plan.autocal`)."""
        with self._lock:
            self.predictor.use_calibration(report)
            self.predictor.update(self.state)

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
            self.status.value = snap.html_lines(lines, css_class="so-dash-status")
        if self.figure is not None and self.simulation is None:
            changed = write_state(self.figure, self.state, self.title_text(), work=self.work,
                                  expected=self.expected)
            if self.plot is not None and (changed or not self.plot.figure):
                self.plot.show_figure(self.figure)
        now = time.monotonic()
        if self._snapshot.shown and (now - self._last_snapshot > SNAPSHOT_EVERY_S):
            self._snapshot.update(snap.text_bundle(["static snapshot (updated every few seconds "
                                                    "while the run goes):", *lines]))
            self._last_snapshot = now

    def set_run_state(self, state: RunState) -> None:
        """Told by the trainer; when the run ends, a final refresh and the live figure is
        replaced by a static one of the whole run."""
        self.run_state = state
        if state.ended:
            self.stop()
            self.refresh(final=True)
            self.finalize()
        else:
            self._redraw()

    def finalize(self, *, whole_run: bool = True) -> None:
        """Swap the live widget for the static figure of the whole run (in place; at the
        kernel's exit, `whole_run=False`: the live state's figure, which is at hand)."""
        with self._lock:
            self._redraw()
            if self._main.shown:
                self._main.update(self._static_bundle() if whole_run else
                                  snap.figure_bundle(self.figure, self.status_lines(), PLOT_CONFIG))
            if self._snapshot.shown:
                self._snapshot.update(snap.text_bundle(["final state:", *self.status_lines()]))
            snap.unregister(self)

    def freeze(self) -> None:
        """What the kernel's exit does to a live dashboard: stop and finalize at once (the
        kernel may be killed seconds after its shutdown request: no second pass over the
        recording here)."""
        self.stop(timeout_s=0.2)
        if self.run_state is RunState.RUNNING:
            self.run_state = RunState.STOPPED
        self.finalize(whole_run=False)
        if self._snapshot.shown:
            self._snapshot.update(snap.text_bundle(["final state:", *self.status_lines(), snap.EXIT_NOTE]))

    def start(self, hz: float | None = None) -> LiveDashboard:
        """Refresh from a daemon thread until `stop()`; returns self."""
        if hz is not None:
            if not hz > 0:
                raise ValueError(f"hz={hz} must be > 0")
            self.refresh_hz = float(hz)
        if self.recorder is None:
            raise ValueError("this dashboard has no engine or recorder to follow (static view)")
        if self.running:
            return self
        self._stop.clear()
        if self._main.shown and self.widget is not None and self._main.frozen:
            # a second run after the first one ended: the live figure comes back in place
            self._main.update(snap.widget_bundle(self.widget, self.status_lines()))
            snap.register(self)
        parent = _env.capture_output_parent()
        self._thread = threading.Thread(target=self._run, args=(parent,),
                                        name="superoffload-dashboard", daemon=True)
        self._thread.start()
        return self

    def _run(self, parent: Any) -> None:
        _env.bind_thread_output(parent)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                self.refresh()
                took = time.perf_counter() - t0
                # a timer, not a poll; and never more than ~1/4 of a core on refreshes
                self._stop.wait(max(1.0 / self.refresh_hz, 3.0 * took))
        except BaseException as exc:  # surface in the cell that started us, then stop
            self.error = exc
            print(f"superoffload dashboard stopped: {exc!r}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the refresher thread (the caller refreshes once more if it wants)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
            lines = [self.base_title]
            lines += [f"DOES NOT FIT: {p}" for p in self.sim.problems]
            return lines
        state = state or self.state
        ratio = getattr(getattr(self.engine, "config", None), "ratio", None)
        lines = status_lines(state, self.work, self.expected, run_state=self.run_state,
                             iteration=self._engine_iteration() if self.engine is not None
                             else state.newest_iteration,
                             ratio_fallback=float(ratio) if ratio is not None else None,
                             title=self.base_title)
        if self.calibration is not None:
            lines.append(self.calibration.line())
        cover = state.coverage()
        if cover is not None and state.stride() > 1:
            lines.append(f"history: iterations {cover[0]}-{cover[1]} in bins of {state.stride()} "
                         "(line = mean, band = min..max of each bin)")
        return lines

    def summary(self) -> str:
        """Plain-text summary (what a terminal sees instead of the figure)."""
        from superoffload.telemetry.vocabulary import describe

        lines = self.status_lines()
        if len(self.state.history_by_rank) > 1:  # data parallel: one line per rank
            for rank in sorted(self.state.history_by_rank):
                recent = self.state.recent(rank)
                if len(recent["iteration"]):
                    last = {k: float(v[-1]) for k, v in recent.items()}
                    lines.append(f"rank {rank}: " + describe(last, (
                        "iteration_ms", "d2h_gbps_busy", "h2d_gbps_busy", "cpu_step_hidden_pct",
                        "device_idle_pct")))
        lines.append(f"timeline: {len(self.state.timeline_spans())} spans drawn")
        return "\n".join(lines)

    def _engine_iteration(self) -> int | None:
        value = getattr(self.engine, "iteration", None)
        return int(value) if isinstance(value, (int, float)) else None

    # ----------------------------------------------------------------- display
    def full_state(self, max_points: int = STATIC_POINTS) -> DashboardState:
        """The whole recorded run as a final state (`fullstate.state_from_recorder`): what a
        static figure or an exported page draws."""
        if self.recorder is None or self.simulation is not None:
            return self.state
        with self._lock:
            return state_from_recorder(self.recorder, window_iterations=self.state.window_iterations,
                                       max_points=max_points, live=self.state)

    def static_figure(self, max_points: int = STATIC_POINTS) -> tuple[Any, list[str]]:
        """(plotly Figure, status lines) of the whole run (a simulation: its own figure)."""
        import plotly.graph_objects as go

        if self.simulation is not None or self.recorder is None:
            return go.Figure(self.figure), self.status_lines()
        state = self.full_state(max_points)
        fig = build_figure(title=self.base_title)
        write_state(fig, state, self.title_text(), work=self.work, expected=self.expected)
        return fig, self.status_lines(state)

    def _static_bundle(self) -> dict[str, Any]:
        fig, lines = self.static_figure()
        return snap.figure_bundle(fig, lines, PLOT_CONFIG)

    def _ipython_display_(self) -> None:
        self.display()

    def display(self) -> None:
        """Show the dashboard in a notebook; degrade with a message elsewhere."""
        if self.figure is None:
            print(f"[superoffload] dashboard needs plotly to draw: {_env.INSTALL_HINT}")
            print(self.summary())
            return
        if not _env.in_notebook():
            print(self.summary())
            print("[superoffload] not in a notebook: dash.to_html('dashboard.html') writes a static page")
            return
        live = self.widget is not None and not (self.run_state is not None and self.run_state.ended)
        if live:
            self._main.show(snap.widget_bundle(self.widget, self.status_lines()))
            snap.register(self)
            self._snapshot.show(snap.text_bundle(["static snapshot (updated every few seconds "
                                                  "while the run goes):", *self.status_lines()]))
            self._last_snapshot = time.monotonic()
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
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config=PLOT_CONFIG)
        path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>"
                        f"{html.escape(self.base_title)}</title></head><body>"
                        f"{snap.html_lines(lines)}{body}</body></html>", encoding="utf-8")
        return path
