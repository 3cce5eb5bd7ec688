"""Optional TensorBoard scalars: loss, tokens/s, link GB/s and overlap per iteration.

    from superoffload.telemetry.tensorboard import write_tensorboard_scalars
    write_tensorboard_scalars(engine.telemetry, "runs/latest/tb", tokens_per_iteration=512)
    # then: tensorboard --logdir runs/latest/tb

TensorBoard is not a dependency: `pip install tensorboard` brings the event-file writer
(`torch.utils.tensorboard.SummaryWriter` needs it). Without it `tensorboard_available()` is
False and the writer raises `ImportError` saying what to install. The figures are the ones
the dashboard draws (`telemetry.metrics.iteration_metrics`), one point per iteration:

  loss                       the engine's "loss" scalar
  throughput/tokens_per_s    tokens_per_iteration / iteration time (when given)
  throughput/iteration_ms    iteration time
  link/d2h_gbps_busy, link/h2d_gbps_busy    rate while the link moved, each direction
  link/d2h_utilisation_pct, ...             bytes / iteration time / peak (when a peak is given)
  overlap/cpu_step_hidden_pct               CPU step hidden under device work (paper §4.2)
  overlap/device_idle_pct
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from superoffload.telemetry import metrics
from superoffload.telemetry.events import Span
from superoffload.telemetry.recorder import Recorder

INSTALL_HINT = "pip install tensorboard"


def tensorboard_available() -> bool:
    """True when the `tensorboard` package (the event-file writer) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def scalar_rows(source: Recorder | Sequence[Span], *, tokens_per_iteration: int | None = None,
                link_peak_gbps: float | None = None) -> list[tuple[str, int, float]]:
    """(tag, iteration, value) rows, the content of the event file (pure: testable without
    TensorBoard). Per-iteration metrics are those of the lowest rank."""
    spans = source.spans() if isinstance(source, Recorder) else list(source)
    ranks = sorted({s.rank for s in spans})
    if len(ranks) > 1:
        spans = [s for s in spans if s.rank == ranks[0]]
    rows: list[tuple[str, int, float]] = []
    if isinstance(source, Recorder):
        rows.extend(("loss", sc.iteration, sc.value) for sc in source.scalars("loss"))
    for m in metrics.iteration_metrics(spans):
        it = m.iteration
        if m.wall_s > 0:
            rows.append(("throughput/iteration_ms", it, m.wall_s * 1e3))
            if tokens_per_iteration:
                rows.append(("throughput/tokens_per_s", it, tokens_per_iteration / m.wall_s))
        if m.d2h_bytes:
            rows.append(("link/d2h_gbps_busy", it, m.d2h_gbps_busy))
        if m.h2d_bytes:
            rows.append(("link/h2d_gbps_busy", it, m.h2d_gbps_busy))
        if link_peak_gbps:
            rows.append(("link/d2h_utilisation_pct", it,
                         metrics.link_utilisation_pct(m.d2h_gbps_wall, link_peak_gbps)))
            rows.append(("link/h2d_utilisation_pct", it,
                         metrics.link_utilisation_pct(m.h2d_gbps_wall, link_peak_gbps)))
        if m.cpu_step_s > 0:
            rows.append(("overlap/cpu_step_hidden_pct", it, 100 * m.cpu_overlap_frac))
        rows.append(("overlap/device_idle_pct", it, 100 * m.device_idle_frac))
    return rows


def write_tensorboard_scalars(source: Recorder | Sequence[Span], logdir: str | Path, *,
                              tokens_per_iteration: int | None = None,
                              link_peak_gbps: float | None = None) -> Path:
    """Write `scalar_rows(...)` as a TensorBoard event file under `logdir`; returns `logdir`.
    Raises ImportError (with the install command) when tensorboard is not installed."""
    if not tensorboard_available():
        raise ImportError(f"TensorBoard scalars need the tensorboard package: {INSTALL_HINT}")
    from torch.utils.tensorboard import SummaryWriter

    out = Path(logdir)
    out.mkdir(parents=True, exist_ok=True)
    rows = scalar_rows(source, tokens_per_iteration=tokens_per_iteration,
                       link_peak_gbps=link_peak_gbps)
    writer = SummaryWriter(log_dir=str(out))
    try:
        for tag, step, value in rows:
            writer.add_scalar(tag, value, global_step=step)
    finally:
        writer.close()
    return out
