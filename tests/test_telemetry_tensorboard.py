"""Optional TensorBoard scalars: the rows are tested without TensorBoard; the event file only
where the `tensorboard` package is installed (it is not a dependency)."""

from __future__ import annotations

from pathlib import Path

import pytest

from superoffload.telemetry import metrics
from superoffload.telemetry.tensorboard import (
    ours,
    scalar_rows,
    tensorboard_available,
    write_tensorboard_scalars,
)
from superoffload.telemetry.vocabulary import METRICS
from tests.widgets_support import filled_recorder


def test_rows_are_the_dashboards_per_iteration_figures_in_the_vocabulary() -> None:
    rec = filled_recorder(4, loss=3.0)
    rows = scalar_rows(rec, tokens_per_iteration=512, link_peak_gbps=10.0)
    by_tag: dict[str, dict[int, float]] = {}
    for tag, it, value in rows:
        by_tag.setdefault(tag, {})[it] = value
    m = {x.iteration: x for x in metrics.iteration_metrics(rec.spans())}
    assert set(by_tag) <= {x.tag for x in METRICS.values()}, "every tag is a vocabulary metric"
    assert by_tag["train/loss"] == {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}
    assert by_tag["time/iteration_ms"][1] == pytest.approx(m[1].wall_s * 1e3), "ms, as on screen"
    assert by_tag["throughput/tokens_per_s"][1] == pytest.approx(512 / m[1].wall_s)
    assert by_tag["link/d2h_gbps_busy"][1] == pytest.approx(m[1].d2h_gbps_busy)
    assert by_tag["link/h2d_gbps_wall"][1] == pytest.approx(m[1].h2d_gbps_wall)
    assert by_tag["link/h2d_link_use_pct"][1] == pytest.approx(100 * m[1].h2d_gbps_wall / 10.0)
    assert by_tag["overlap/cpu_step_hidden_pct"][1] == pytest.approx(100 * m[1].cpu_overlap_frac)
    assert "throughput/tokens_per_s" not in {t for t, _, _ in scalar_rows(rec)}


def test_without_tensorboard_the_writer_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    import superoffload.telemetry.tensorboard as tb

    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        write_tensorboard_scalars(filled_recorder(2), tmp_path / "tb")


@pytest.mark.skipif(not tensorboard_available(),
                    reason="tensorboard is not installed (optional: pip install tensorboard)")
def test_event_file_holds_the_scalars_and_a_rerun_replaces_it(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    logdir.mkdir()
    theirs = logdir / "events.out.tfevents.1.host.1.0"  # someone else's run in the folder
    theirs.write_bytes(b"")
    first = write_tensorboard_scalars(filled_recorder(4, loss=3.0), logdir,
                                      tokens_per_iteration=512, link_peak_gbps=10.0)
    again = write_tensorboard_scalars(filled_recorder(6, loss=3.0), logdir,
                                      tokens_per_iteration=512, link_peak_gbps=10.0)
    assert ours(logdir) == [again] and not first.exists(), "one run, one file"
    assert theirs.exists(), "files we did not write are left alone"
    acc = EventAccumulator(str(again))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "throughput/tokens_per_s", "link/d2h_gbps_busy",
            "overlap/device_idle_pct"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2, 3, 4, 5]
