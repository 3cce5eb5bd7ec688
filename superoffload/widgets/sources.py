"""Where the dashboard's inputs come from: the source it follows, the workload the planner
and the throughput figures need, and the memory in use (probes that never import a library
just to answer)."""

from __future__ import annotations

from typing import Any

from superoffload.widgets.panels import Workload
from superoffload.widgets.predict import ProfileChoice


def is_recorder(source: Any) -> bool:
    from superoffload.telemetry.recorder import Recorder

    return isinstance(source, Recorder)


def resolve_source(source: Any) -> tuple[Any, Any]:
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
        "superoffload.telemetry.Recorder; for spans use LiveDashboard.from_spans(spans), for a "
        "simulation dash.show_simulation(plan.simulate(...))")


def workload(shape: Any, choice: ProfileChoice | None) -> Workload:
    prof = choice.profile if choice is not None else None
    return Workload(
        tokens_per_iteration=int(shape.tokens) if shape is not None else None,
        flops_per_iteration=float(shape.executed_flops) if shape is not None else None,
        d2h_peak_gbps=getattr(prof, "d2h_gbps", None), h2d_peak_gbps=getattr(prof, "h2d_gbps", None),
        profile_name=choice.name if choice is not None else "",
        profile_note=choice.note if choice is not None else "")


def process_rss_bytes() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.Process().memory_info().rss)


def cuda_allocated_bytes() -> float | None:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to draw
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return float(torch.cuda.memory_allocated())
