"""Optional TensorBoard scalars: the rows are tested without TensorBoard; the event file only
where the `tensorboard` package is installed (it is not a dependency)."""

from __future__ import annotations

from pathlib import Path

import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry.tensorboard import (
    scalar_rows,
    tensorboard_available,
    write_tensorboard_scalars,
)
from tests.widgets_support import filled_recorder


def test_rows_are_the_dashboards_per_iteration_figures() -> None:
    rec = filled_recorder(4, loss=3.0)
    rows = scalar_rows(rec, tokens_per_iteration=512, link_peak_gbps=10.0)
    by_tag: dict[str, dict[int, float]] = {}
    for tag, it, value in rows:
        by_tag.setdefault(tag, {})[it] = value
    m = {x.iteration: x for x in metrics.iteration_metrics(rec.spans())}
    assert by_tag["loss"] == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}
    assert by_tag["throughput/tokens_per_s"][1] == pytest.approx(512 / m[1].wall_s)
    assert by_tag["link/d2h_gbps_busy"][1] == pytest.approx(m[1].d2h_gbps_busy)
    assert by_tag["link/h2d_utilisation_pct"][1] == pytest.approx(100 * m[1].h2d_gbps_wall / 10.0)
    assert by_tag["overlap/cpu_step_hidden_pct"][1] == pytest.approx(100 * m[1].cpu_overlap_frac)
    assert "throughput/tokens_per_s" not in {t for t, _, _ in scalar_rows(rec)}


def test_without_tensorboard_the_writer_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    import superoffload.telemetry.tensorboard as tb

    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        write_tensorboard_scalars(filled_recorder(2), tmp_path / "tb")


@pytest.mark.skipif(not tensorboard_available(),
                    reason="tensorboard is not installed (optional: pip install tensorboard)")
def test_event_file_holds_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = write_tensorboard_scalars(filled_recorder(4, loss=3.0), tmp_path / "tb",
                                       tokens_per_iteration=512, link_peak_gbps=10.0)
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "throughput/tokens_per_s", "link/d2h_gbps_busy", "overlap/device_idle_pct"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2, 3]
