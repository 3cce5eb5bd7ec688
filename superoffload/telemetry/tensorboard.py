"""Optional TensorBoard scalars: the run's per-iteration figures, in the metric vocabulary.

    from superoffload.telemetry.tensorboard import write_tensorboard_scalars
    write_tensorboard_scalars(engine.telemetry, "runs/latest/tb", tokens_per_iteration=512)
    # then: tensorboard --logdir runs/latest/tb

TensorBoard is not a dependency: `pip install tensorboard` brings the event-file writer
(`torch.utils.tensorboard.SummaryWriter` needs it). Without it `tensorboard_available()` is
False and the writer raises `ImportError` saying what to install.

Tags are `<group>/<name>` of `telemetry.vocabulary` (the names the dashboard, the CLI, the
Trainer/Lightning logs and the trace use; the same units): `time/iteration_ms`,
`throughput/tokens_per_s`, `link/d2h_gbps_busy`, `link/d2h_link_use_pct`,
`overlap/cpu_step_hidden_pct`, `train/loss`, ... one point per iteration.

One run, one file: the writer replaces the event file it wrote before in the same folder (a
notebook's export cell run twice used to leave two files, and TensorBoard drew both), and
leaves files it did not write alone.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

from superoffload.telemetry import metrics
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.events import Span
from superoffload.telemetry.recorder import Recorder

_INSTALL_HINT = "pip install tensorboard"
FILE_SUFFIX = ".superoffload"
"""The suffix of the event files this module writes (`SummaryWriter(filename_suffix=...)`):
how it recognises its own file to replace."""


def tensorboard_available() -> bool:
    """True when the `tensorboard` package (the event-file writer) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def scalar_rows(source: Recorder | Sequence[Span], *, tokens_per_iteration: int | None = None,
                link_peak_gbps: float | None = None, d2h_peak_gbps: float | None = None,
                h2d_peak_gbps: float | None = None) -> list[tuple[str, int, float]]:
    """(tag, iteration, value) rows, the content of the event file (pure: testable without
    TensorBoard). Per-iteration metrics are those of the lowest rank; `link_peak_gbps` sets
    both directions' peak (or give each)."""
    spans = source.spans() if isinstance(source, Recorder) else list(source)
    ranks = sorted({s.rank for s in spans})
    if len(ranks) > 1:
        spans = [s for s in spans if s.rank == ranks[0]]
    d2h_peak = d2h_peak_gbps or link_peak_gbps
    h2d_peak = h2d_peak_gbps or link_peak_gbps
    rows: list[tuple[str, int, float]] = []
    if isinstance(source, Recorder):
        for name in ("loss", "grad_norm", "loss_scale", "lr"):
            for sc in source.scalars(name):
                to, value = vocab.engine_scalar(name, sc.value)
                if math.isfinite(value):
                    rows.append((vocab.METRICS[to].tag, sc.iteration, value))
    for m in metrics.iteration_metrics(spans):
        if not m.wall_s > 0:
            continue
        values = vocab.iteration_values(m)
        values.update(vocab.workload_values(values["iteration_ms"],
                                            tokens_per_iteration=tokens_per_iteration))
        values.update(vocab.link_use_values(m.d2h_gbps_wall, m.h2d_gbps_wall,
                                            d2h_peak_gbps=d2h_peak, h2d_peak_gbps=h2d_peak))
        for name, value in values.items():
            # no rate for a direction that moved nothing
            if math.isfinite(value):
                rows.append((vocab.METRICS[name].tag, m.iteration, value))
    return rows


def write_tensorboard_scalars(source: Recorder | Sequence[Span], logdir: str | Path, *,
                              tokens_per_iteration: int | None = None,
                              link_peak_gbps: float | None = None,
                              d2h_peak_gbps: float | None = None,
                              h2d_peak_gbps: float | None = None) -> Path:
    """Write `scalar_rows(...)` as ONE TensorBoard event file under `logdir` (replacing the
    one this function wrote there before); returns the file's path. Raises ImportError
    (with the install command) when tensorboard is not installed."""
    if not tensorboard_available():
        raise ImportError(f"TensorBoard scalars need the tensorboard package: {_INSTALL_HINT}")
    from torch.utils.tensorboard import SummaryWriter

    out = Path(logdir)
    out.mkdir(parents=True, exist_ok=True)
    rows = scalar_rows(source, tokens_per_iteration=tokens_per_iteration,
                       link_peak_gbps=link_peak_gbps, d2h_peak_gbps=d2h_peak_gbps,
                       h2d_peak_gbps=h2d_peak_gbps)
    before = set(ours(out))
    writer = SummaryWriter(log_dir=str(out), filename_suffix=FILE_SUFFIX)
    try:
        for tag, step, value in rows:
            writer.add_scalar(tag, value, global_step=step)
    finally:
        writer.close()
    # the new file is complete: the previous export goes
    for old in before:
        old.unlink(missing_ok=True)
    (new,) = set(ours(out)) - before
    return new


def ours(logdir: Path) -> list[Path]:
    """The event files this module wrote in `logdir`."""
    return sorted(logdir.glob(f"events.out.tfevents.*{FILE_SUFFIX}"))
