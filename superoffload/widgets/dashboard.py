"""`LiveDashboard`: a live view of the engine's telemetry (or of a simulated timeline).

    dash = LiveDashboard(engine)       # or a telemetry Recorder
    dash                               # last expression of a cell: shows one FigureWidget
    dash.start()                       # refresh from a background thread at ~5 Hz
    ...                                # training runs (see BackgroundTrainer)
    dash.stop(); dash.to_html("artifacts/dashboard.html")

One FigureWidget per dashboard, created once: each ships ~5 MB of JavaScript to the browser
(plotly >= 6 is an anywidget), so refreshes only assign numpy arrays to existing traces in a
`batch_update`, throttled to `refresh_hz`. Widget updates sent from a thread reach the
browser while other cells run; this class never needs widget *input*, so it needs no
cooperation from the kernel's main thread.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from superoffload.telemetry.events import Span
from superoffload.widgets import _env
from superoffload.widgets.figure import build_figure, write_state
from superoffload.widgets.series import DashboardState


class LiveDashboard:
    """Timeline, link GB/s each way, overlap and device idle, memory, loss. Spans of several
    ranks (e.g. `from_spans(telemetry.ranks.merge_rank_spans([...]))`) get per-rank lanes."""

    def __init__(
        self,
        source: Any = None,
        *,
        window_iterations: int = 6,
        refresh_hz: float = 4.0,
        live: bool | None = None,
        title: str = "superoffload",
    ) -> None:
        if not refresh_hz > 0:
            raise ValueError(f"refresh_hz={refresh_hz} must be > 0 (refreshes per second, ~5-10)")
        self.engine, self.recorder = _resolve_source(source)
        self.refresh_hz = float(refresh_hz)
        self.base_title = title
        self.state = DashboardState(window_iterations=window_iterations)
        self.live = _env.live_widgets_available() if live is None else bool(live)
        if self.live and not _env.live_widgets_available():
            raise _env.WidgetsUnavailable(
                f"live=True needs {', '.join(_env.missing_for_live())}: {_env.INSTALL_HINT}"
            )
        self.figure: Any = (
            build_figure(live=self.live, title=title) if _env.plotly_available() else None
        )
        self.refreshes = 0
        self.error: BaseException | None = None
        self.simulation: Any = None
        self._seq = -1
        self._scalar_t: dict[str, float] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- sources
    @classmethod
    def from_spans(cls, spans: Iterable[Span], *, title: str = "timeline", **kw: Any) -> LiveDashboard:
        """A static dashboard of `spans` (e.g. a simulated timeline), every iteration drawn."""
        spans = list(spans)
        iterations = {s.iteration for s in spans}
        kw.setdefault("window_iterations", max(1, len(iterations)))
        dash = cls(None, title=title, **kw)
        dash.state.add_spans(spans, final=True)
        dash._redraw()
        return dash

    def show_simulation(self, result: Any, *, title: str | None = None, steady_only: bool = True) -> None:
        """Draw a planner result (`plan.simulate(...)`): its timeline uses the engine's span
        format, so the same lanes show predicted instead of measured work."""
        spans = list(result.timeline)
        window = getattr(result, "window", None)
        if steady_only and window is not None:
            # the simulator runs a few iterations to reach steady state: draw the spans that
            # touch the steady iteration's window (paper Fig. 5 shows one iteration)
            w0, w1 = window
            spans = [s for s in spans if s.end_s > w0 and s.start_s < w1]
        with self._lock:
            self.simulation = result
            self.state = DashboardState(
                window_iterations=max(1, len({s.iteration for s in spans})),
                max_points=self.state.max_points,
            )
            self.state.add_spans(spans, final=True)
            end_s = max((s.end_s for s in spans), default=0.0)
            host, device = _simulated_memory_bytes(result)
            self.state.add_memory(0.0, host, device)
            self.state.add_memory(end_s, host, device)
            self.base_title = title or _simulation_title(result)
            self._redraw()

    # ----------------------------------------------------------------- updates
    def refresh(self, *, final: bool = False) -> bool:
        """Pull new telemetry and redraw; returns True when something new arrived.
        Safe to call from any thread (the refresher thread calls it at `refresh_hz`)."""
        if self.recorder is None:
            return False
        with self._lock:
            spans, self._seq = self.recorder.spans_since(self._seq)
            new_scalars = False
            for name in ("loss", "ratio"):
                fresh = [
                    s for s in self.recorder.scalars(name) if s.time_s > self._scalar_t.get(name, -1.0)
                ]
                if fresh:
                    self._scalar_t[name] = fresh[-1].time_s
                    self.state.add_scalars(name, ((s.iteration, s.value) for s in fresh))
                    new_scalars = True
            self.state.add_spans(spans, final=final)
            host, device = self._memory_bytes()
            self.state.add_memory(self.recorder.now(), host, device)
            self._redraw()
            self.refreshes += 1
            return bool(spans) or new_scalars

    def _redraw(self) -> None:
        if self.figure is not None:
            write_state(self.figure, self.state, self.title_text())

    def start(self, hz: float | None = None) -> LiveDashboard:
        """Refresh from a daemon thread until `stop()`; returns self (so `dash.start()` as
        the last line of a cell also shows the dashboard)."""
        if hz is not None:
            if not hz > 0:
                raise ValueError(f"hz={hz} must be > 0")
            self.refresh_hz = float(hz)
        if self.recorder is None:
            raise ValueError("this dashboard has no engine or recorder to follow (static view)")
        if self.running:
            return self
        self._stop.clear()
        parent = _env.capture_output_parent()
        self._thread = threading.Thread(
            target=self._run, args=(parent,), name="superoffload-dashboard", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, parent: Any) -> None:
        _env.bind_thread_output(parent)
        try:
            while not self._stop.is_set():
                self.refresh()
                # A timer, not a poll of shared state: the refresh rate is the throttle.
                self._stop.wait(1.0 / self.refresh_hz)
            self.refresh(final=True)
        except BaseException as exc:  # surface in the cell that started us, then stop
            self.error = exc
            print(f"superoffload dashboard stopped: {exc!r}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the refresher thread (after one final refresh)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- reading
    def title_text(self) -> str:
        parts = [self.base_title]
        iteration = self._engine_iteration()
        if iteration is None and self.state.newest_iteration >= 0:
            iteration = self.state.newest_iteration
        if iteration is not None and self.simulation is None:
            parts.append(f"iteration {iteration}")
        ratio = self.state.ratio_in_force()
        if ratio is not None:
            parts.append(f"ratio {ratio[0]:.2f} (since it. {ratio[1]})")
        elif self.engine is not None and hasattr(self.engine, "config"):
            parts.append(f"ratio {float(self.engine.config.ratio):.2f}")
        if self.state.total_rollbacks:
            parts.append(f"{self.state.total_rollbacks} rollbacks")
        text = " · ".join(parts)
        notes = self.recorder.notes() if self.recorder is not None else []
        if notes:  # the engine's plain-language events: reconfigure, adaptive STV, ...
            last = notes[-1]
            text += f"<br><sup>it. {last.iteration}: {html.escape(last.text)}</sup>"
        return text

    def summary(self) -> str:
        """Plain-text summary (what a terminal sees instead of the figure)."""
        series = self.state.series()
        lines = [self.title_text()]
        if len(series["iteration"]):
            lines.append(
                f"last iteration: D2H {series['d2h_gbps'][-1]:.2f} GB/s, "
                f"H2D {series['h2d_gbps'][-1]:.2f} GB/s, overlap {series['overlap_frac'][-1]:.0%}, "
                f"device idle {series['device_idle_frac'][-1]:.0%}"
            )
        if len(self.state.points_by_rank) > 1:  # data parallel: one line per rank
            for rank in sorted(self.state.points_by_rank):
                rs = self.state.series(rank)
                if len(rs["iteration"]):
                    lines.append(
                        f"rank {rank}: {rs['wall_s'][-1] * 1e3:.1f} ms, D2H "
                        f"{rs['d2h_gbps'][-1]:.2f} GB/s, H2D {rs['h2d_gbps'][-1]:.2f} GB/s, "
                        f"overlap {rs['overlap_frac'][-1]:.0%}, idle "
                        f"{rs['device_idle_frac'][-1]:.0%}")
        lines.append(f"timeline: {len(self.state.timeline_spans())} spans drawn")
        return "\n".join(lines)

    def _engine_iteration(self) -> int | None:
        value = getattr(self.engine, "iteration", None)
        return int(value) if isinstance(value, (int, float)) else None

    def _memory_bytes(self) -> tuple[float | None, float | None]:
        """(host, device) bytes in use: the engine's own scalars when it records them, else
        this process's resident memory and the CUDA allocator's count; on a CPU-only host the
        device side falls back to the engine's device-resident weight bytes, which is what
        weight-flow bounds by its prefetch depth (paper §4.5)."""
        assert self.recorder is not None
        host_s = self.recorder.scalars("host_mem_bytes")
        device_s = self.recorder.scalars("device_mem_bytes")
        host = host_s[-1].value if host_s else _process_rss_bytes()
        device = device_s[-1].value if device_s else _cuda_allocated_bytes()
        if device is None:
            weights_s = self.recorder.scalars("device_weight_bytes")
            device = weights_s[-1].value if weights_s else None
        return host, device

    # ----------------------------------------------------------------- display
    @property
    def widget(self) -> Any:
        """The FigureWidget (to put in an ipywidgets layout); None when not live."""
        return self.figure if self.live else None

    def _ipython_display_(self) -> None:
        self.display()

    def display(self) -> None:
        """Show the live figure in a notebook; degrade with a message elsewhere."""
        if self.figure is None:
            print(f"[superoffload] dashboard needs plotly to draw: {_env.INSTALL_HINT}")
            print(self.summary())
            return
        if not _env.in_notebook():
            print(self.summary())
            print("[superoffload] not in a notebook: dash.to_html('dashboard.html') writes a static page")
            return
        from IPython.display import display

        if not self.live:
            print(f"[superoffload] live widgets need {', '.join(_env.missing_for_live())}: "
                  f"showing a static snapshot. {_env.INSTALL_HINT}")
        display(self.figure)

    def to_html(self, path: str | Path, *, include_plotlyjs: bool | str = True) -> Path:
        """Write the current view as a self-contained HTML page (plotly.js embedded, so it
        opens offline); returns the path."""
        _env.require_plotly("LiveDashboard.to_html")
        import plotly.graph_objects as go

        with self._lock:
            fig = go.Figure(self.figure)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.write_html(str(path), include_plotlyjs=include_plotlyjs, full_html=True)
        return path


def _resolve_source(source: Any) -> tuple[Any, Any]:
    """(engine or None, recorder or None) from an engine, a Recorder or None."""
    from superoffload.telemetry.recorder import Recorder

    if source is None:
        return None, None
    if isinstance(source, Recorder):
        return None, source
    recorder = getattr(source, "telemetry", None)
    if isinstance(recorder, Recorder):
        return source, recorder
    raise TypeError(
        f"LiveDashboard(source={type(source).__name__}): pass an engine (with .telemetry) or a "
        "superoffload.telemetry.Recorder; for a simulation use LiveDashboard.from_spans(res.timeline)"
    )


def _simulation_title(result: Any) -> str:
    parts = ["simulated"]
    iteration_s = getattr(result, "iteration_s", None)
    if iteration_s is not None:
        parts.append(f"{float(iteration_s) * 1e3:.1f} ms/iteration")
    tflops = getattr(result, "tflops", None)
    if tflops is not None:
        parts.append(f"{float(tflops):.0f} TFLOPS")
    return " · ".join(parts)


def _simulated_memory_bytes(result: Any) -> tuple[float | None, float | None]:
    memory = getattr(result, "memory", None)
    host = _first_attr(memory, ("host_bytes", "host_total_bytes", "host"))
    device = _first_attr(memory, ("device_bytes", "device_total_bytes", "device"))
    return host, device


def _first_attr(obj: Any, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _process_rss_bytes() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.Process().memory_info().rss)


def _cuda_allocated_bytes() -> float | None:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to draw
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return float(torch.cuda.memory_allocated())
