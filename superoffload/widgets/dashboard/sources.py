"""Where the dashboard's inputs come from: the source it follows, the workload the planner
and the throughput figures need, and the memory in use (probes that never import a library
just to answer)."""

from __future__ import annotations

from typing import Any

from superoffload.widgets.dashboard.link import link_of
from superoffload.widgets.dashboard.status import Workload
from superoffload.widgets.shared.profile import ProfileChoice


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


def workload(shape: Any, choice: ProfileChoice | None, micro_batches: int = 1) -> Workload:
    """Tokens and FLOPs of one optimizer step (`micro_batches` forward/backward passes of
    `shape`: the engine's grad_accum_steps), the link's peaks, the profile's name."""
    prof = choice.profile if choice is not None else None
    tokens = flops = None
    if shape is not None:
        # one optimizer step is `micro_batches` passes: the measured iteration counts them all
        tokens = int(shape.tokens) * micro_batches
        flops = float(shape.executed_flops) * micro_batches
    return Workload(
        tokens_per_iteration=tokens, flops_per_iteration=flops,
        d2h_peak_gbps=getattr(prof, "d2h_gbps", None),
        h2d_peak_gbps=getattr(prof, "h2d_gbps", None),
        profile_name=choice.name if choice is not None else "",
        profile_note=choice.note if choice is not None else "", micro_batches=micro_batches,
        link_rate_kind=link_rate_kind(choice), link=link_of(prof))


def link_rate_kind(choice: ProfileChoice | None) -> str:
    """What the profile's link rates are (`status.Workload.link_rate_kind`): fitted to a run
    (a calibrated profile), this machine's measured best copy, or a preset's peak."""
    if choice is None:
        return "peak"
    if choice.calibrated:
        return "fitted"
    return "measured" if choice.of_this_machine else "peak"


def predicted_step(shape: Any, profile: Any, config: Any,
                   micro_batches: int = 1) -> tuple[float, float]:
    """(seconds, executed TFLOP/s) the planner predicts for ONE optimizer step of
    `micro_batches` micro-batches, so it compares with a measured iteration (like with like).
    The planner times one micro-batch per step; with accumulation each extra micro-batch adds
    its forward and backward (the buckets leave on the last one only), which we add as the
    extra micro-batches' share of the one-micro-batch compute time."""
    from superoffload import plan

    res = plan.simulate(shape, profile, system="superoffload", config=config)
    seconds, tflops = float(res.iteration_s), float(res.tflops)
    if micro_batches > 1:
        # one micro-batch's forward + backward
        compute_s = seconds * _compute_share(res)
        seconds += (micro_batches - 1) * compute_s
        tflops = float(shape.executed_flops) * micro_batches / seconds / 1e12
    return seconds, tflops


def _compute_share(res: Any) -> float:
    """The share of a simulated iteration the device spent on forward/backward (1.0 when the
    result has no timeline to tell)."""
    from superoffload.telemetry import intervals, metrics

    spans = list(getattr(res, "timeline", ()) or ())
    window = getattr(res, "window", None)
    if not spans or not window or not window[1] > window[0]:
        return 1.0
    compute = intervals.length(intervals.clip(metrics.model_compute(spans), tuple(window)))
    return min(1.0, compute / (window[1] - window[0]))


def memory_bytes(recorder: Any) -> tuple[float | None, float | None]:
    """(host, device) bytes: the engine's scalars when it records them, else this process's
    resident memory and the CUDA allocator's count (None: unknown, not drawn; a CPU-only run
    has no device memory to show)."""
    host_s = recorder.latest_scalar("host_mem_bytes")
    device_s = recorder.latest_scalar("device_mem_bytes")
    host = host_s.value if host_s is not None else process_rss_bytes()
    device = device_s.value if device_s is not None else cuda_allocated_bytes()
    return host, device


def process_rss_bytes() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.Process().memory_info().rss)


def cuda_allocated_bytes() -> float | None:
    import sys

    # never import torch just to draw
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return float(torch.cuda.memory_allocated())
