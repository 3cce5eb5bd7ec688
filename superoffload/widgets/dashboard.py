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
(a loaded machine keeps its cores for training). When the run ends the widget is replaced in
place by a static figure of the last state (snapshot.py), so a saved notebook reopens with
the figure.
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
from superoffload.widgets.panels import Expected, status_lines
from superoffload.widgets.predict import ProfileChoice, resolve_profile, to_shape
from superoffload.widgets.runstate import RunState
from superoffload.widgets.series import DashboardState
from superoffload.widgets.sources import (
    cuda_allocated_bytes,
    is_recorder,
    process_rss_bytes,
    resolve_source,
    workload,
)

SNAPSHOT_EVERY_S = 5.0


class LiveDashboard:
    """Status line and figure of a run (see the module docstring). Spans of several ranks
    (`from_spans(telemetry.ranks.merge_rank_spans([...]))`) get per-rank lanes."""

    def __init__(self, source: Any = None, *, shape: Any = None, seq: int | None = None,
                 micro_batch: int = 1, profile: Any = None, window_iterations: int = 4,
                 refresh_hz: float = 2.0, live: bool | None = None,
                 title: str = "superoffload") -> None:
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
        self.profile: ProfileChoice | None = resolve_profile(profile) if want_profile else None
        self.work = workload(self.shape, self.profile)
        self.expected: list[Expected] = []
        self._expected_key: Any = None
        self._expected_notes = 0
        self.run_state: RunState | None = None
        self.simulation: Any = None
        self.sim: Any = None
        """The simulated layout's figures (`simfigure.SimFigures`) after `show_simulation`."""
        self.figure: Any = build_figure(title=title) if _env.plotly_available() else None
        following = self.live and self.recorder is not None
        self.status: Any = _status_widget() if following else None
        self.plot: Any = _live_plot() if following else None
        self.widget: Any = _vbox(self.status, self.plot) if following else None
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
        timeline) or a Recorder (its notes and scalars too), every iteration drawn."""
        kw.setdefault("live", False)
        if isinstance(source, Iterable) and not is_recorder(source):
            spans = list(source)
            kw.setdefault("window_iterations", max(1, len({s.iteration for s in spans})))
            dash = cls(None, title=title, **kw)
            dash.state.add_spans(spans, final=True)
        else:
            kw.setdefault("window_iterations", max(1, len(source.iterations())))
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
            for name in ("loss", "ratio", "skipped"):
                fresh = [s for s in self.recorder.scalars(name)
                         if s.time_s > self._scalar_t.get(name, -1.0)]
                if fresh:
                    self._scalar_t[name] = fresh[-1].time_s
                    self.state.add_scalars(name, ((s.iteration, s.value) for s in fresh))
                    fresh_scalars = True
            self.state.add_notes([(n.iteration, n.text) for n in self.recorder.notes()])
            self.state.add_spans(spans, final=final)
            if self.state.complete_through >= 0 and self.state.complete_through not in self.state.memory:
                host, device = self._memory_bytes()  # one sample per complete iteration
                self.state.add_memory(self.state.complete_through, host, device)
            self._update_expected()
            self._redraw()
            self.refreshes += 1
            return bool(spans) or fresh_scalars

    def _update_expected(self) -> None:
        """Re-predict when the engine's settings changed (a reconfiguration starts a step)."""
        if self.shape is None or self.profile is None or self.engine is None:
            return
        config = getattr(self.engine, "config", None)
        key = repr(config)
        notes = len(self.state.reconfigures)
        if config is None or (key == self._expected_key and notes == self._expected_notes):
            return
        # the step starts where the engine's note says the change holds; without a note yet
        # (the config is swapped a moment before the note is written), at the next iteration
        start = max(self.state.complete_through + 1, 0) if self.expected else 0
        if notes > self._expected_notes and self.expected:
            start = self.state.reconfigures[-1][0]
        self._expected_notes = notes
        if key == self._expected_key:  # the note of a change already predicted: move its step
            last = self.expected.pop()
            res_s, tflops = last.iteration_s, last.tflops
        else:
            from superoffload import plan

            res = plan.simulate(self.shape, self.profile.profile, schedule="superoffload", config=config)
            res_s, tflops = float(res.iteration_s), float(res.tflops)
        self.expected = [e for e in self.expected if e.from_iteration < start]
        self.expected.append(Expected(start, res_s, tflops))
        self._expected_key = key

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
        replaced by a static one of the last state."""
        self.run_state = state
        if state.ended:
            self.stop()
            self.refresh(final=True)
            self.finalize()
        else:
            self._redraw()

    def finalize(self) -> None:
        """Swap the live widget for the static figure of the current state (in place)."""
        with self._lock:
            self._redraw()
            if self._main.shown:
                self._main.update(self._static_bundle())
            if self._snapshot.shown:
                self._snapshot.update(snap.text_bundle(["final state:", *self.status_lines()]))

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
        if self._main.shown and self.widget is not None:
            self._main.update(snap.widget_bundle(self.widget, self.status_lines()))
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

    def status_lines(self) -> list[str]:
        """The status as plain-text lines (no markup)."""
        if self.simulation is not None:
            lines = [self.base_title]
            lines += [f"DOES NOT FIT: {p}" for p in self.sim.problems]
            return lines
        ratio = getattr(getattr(self.engine, "config", None), "ratio", None)
        return status_lines(self.state, self.work, self.expected, run_state=self.run_state,
                            iteration=self._engine_iteration() if self.engine is not None
                            else self.state.newest_iteration,
                            ratio_fallback=float(ratio) if ratio is not None else None,
                            title=self.base_title)

    def summary(self) -> str:
        """Plain-text summary (what a terminal sees instead of the figure)."""
        lines = self.status_lines()
        if len(self.state.points_by_rank) > 1:  # data parallel: one line per rank
            for rank in sorted(self.state.points_by_rank):
                rs = self.state.series(rank)
                if len(rs["iteration"]):
                    lines.append(f"rank {rank}: {rs['wall_ms'][-1]:.1f} ms, D2H "
                                 f"{rs['d2h_gbps_busy'][-1]:.3g} GB/s, H2D {rs['h2d_gbps_busy'][-1]:.3g}"
                                 f" GB/s, CPU hidden {rs['overlap_pct'][-1]:.0f} %, idle "
                                 f"{rs['idle_pct'][-1]:.0f} %")
        lines.append(f"timeline: {len(self.state.timeline_spans())} spans drawn")
        return "\n".join(lines)

    def _engine_iteration(self) -> int | None:
        value = getattr(self.engine, "iteration", None)
        return int(value) if isinstance(value, (int, float)) else None

    def _memory_bytes(self) -> tuple[float | None, float | None]:
        """(host, device) bytes: the engine's scalars when it records them, else this
        process's resident memory and the CUDA allocator's count (None: unknown, not drawn;
        a CPU-only run has no device memory to show)."""
        assert self.recorder is not None
        host_s = self.recorder.scalars("host_mem_bytes")
        device_s = self.recorder.scalars("device_mem_bytes")
        host = host_s[-1].value if host_s else process_rss_bytes()
        device = device_s[-1].value if device_s else cuda_allocated_bytes()
        return host, device

    # ----------------------------------------------------------------- display
    def _static_bundle(self) -> dict[str, Any]:
        return snap.figure_bundle(self.figure, self.status_lines(), PLOT_CONFIG)

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
            self._snapshot.show(snap.text_bundle(["static snapshot (updated every few seconds "
                                                  "while the run goes):", *self.status_lines()]))
            self._last_snapshot = time.monotonic()
        else:
            if self.recorder is not None and not self.live:
                print(f"[superoffload] live widgets need {', '.join(_env.missing_for_live())}: "
                      f"showing a static snapshot. {_env.INSTALL_HINT}")
            self._main.show(self._static_bundle())

    def to_html(self, path: str | Path, *, include_plotlyjs: bool | str = True) -> Path:
        """Write the current view as a self-contained HTML page (plotly.js embedded, so it
        opens offline); returns the path."""
        _env.require_plotly("LiveDashboard.to_html")
        import plotly.graph_objects as go

        with self._lock:
            fig = go.Figure(self.figure)
            lines = self.status_lines()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config=PLOT_CONFIG)
        path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>"
                        f"{html.escape(self.base_title)}</title></head><body>"
                        f"{snap.html_lines(lines)}{body}</body></html>", encoding="utf-8")
        return path


def _status_widget() -> Any:
    import ipywidgets as w

    status = w.HTML(value="", layout=w.Layout(width="100%"))
    status.add_class("so-dash-status")
    return status


def _live_plot() -> Any:
    from superoffload.widgets.liveplot import live_plot_class

    plot = live_plot_class()(config=dict(PLOT_CONFIG))
    plot.add_class("so-dashboard-plot")
    plot.layout.width = "100%"
    return plot


def _vbox(status: Any, figure: Any) -> Any:
    import ipywidgets as w

    box = w.VBox([status, figure], layout=w.Layout(width="100%"))
    box.add_class("so-dashboard")
    return box
